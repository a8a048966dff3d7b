"""Data-parallel SGD through either engine, side by side: samples per second of algo=dpsgd
on 2 local ranks with Horovod's DistributedOptimizer (horovodrun --gloo, tuned the way a
Horovod user would: fp16 compression, 128 MB fusion buffer, 5 ms cycle) and with
torch.distributed's DistributedDataParallel (torchrun, Gloo; buckets allreduced during the
backward pass, fp16 by a comm hook). Each setting is measured with and without fp16; the
runs alternate, --reps times, and each figure is the median (with the range).

    python -m bench.dpsgd_engines [--quick] [--reps 3] [--epochs 1]

samples/s counts training only: the run's wall seconds less its evaluations'.
"""
from __future__ import annotations

import argparse
import statistics

from bench.common import VENV_BIN, emit, tmpdir, train

HVD_TUNED = {"HOROVOD_FUSION_THRESHOLD": str(128 * 2**20), "HOROVOD_CYCLE_TIME": "5"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=1.0)
    a = ap.parse_args(argv)
    epochs = 0.25 if a.quick else a.epochs
    reps = 1 if a.quick else a.reps
    base = ["--config", "configs/fashion_parle.yaml", "algo=dpsgd", f"train.epochs={epochs}", "eval.every=100",
            "run.ckpt_every=0", "run.tensorboard=false"]
    torchrun = [f"{VENV_BIN}/torchrun", "--standalone", "--nproc-per-node", "2", "--no-python"]
    out = tmpdir("dpsgd_engines")
    rate = {}
    for rep in range(reps):
        for fp16 in (True, False):
            for eng, launcher, env in (("horovod", None, HVD_TUNED), ("torch", torchrun, {"OMP_NUM_THREADS": "1"})):
                s = train([*base, f"dpsgd.fp16={str(fp16).lower()}", f"dist.engine={eng}"], launcher=launcher,
                          env=env, run_dir=out / f"{eng}-fp16{int(fp16)}-{rep}")
                assert s["engine"] == eng, s["engine"]
                rate.setdefault((eng, fp16), []).append(s["samples_seen"] / (s["wall_seconds"] - s["eval_seconds"]))
    for fp16 in (True, False):
        tag = "fp16" if fp16 else "fp32"
        for eng in ("horovod", "torch"):
            v = rate[(eng, fp16)]
            emit(f"dpsgd_{tag}_{eng}_samples_per_sec", statistics.median(v))
            emit(f"dpsgd_{tag}_{eng}_samples_per_sec_range", f"{min(v):.0f}-{max(v):.0f}")
        emit(f"dpsgd_{tag}_ddp_over_horovod", statistics.median(rate[("torch", fp16)])
             / statistics.median(rate[("horovod", fp16)]))
    emit("dpsgd_runs_per_setting", reps)


if __name__ == "__main__":
    main()
