"""Bytes and collective calls per training sample, from the comm module's counters, for
parle, localsgd, diloco, elastic and dpsgd: 2 ranks, LeNet on Fashion-MNIST, the same
number of samples each, one evaluation at the end (its bytes included).

    python -m bench.communication [--quick]
    target: bytes_per_sample_ratio (parle / dpsgd) <= 1 / L
"""
from __future__ import annotations

import argparse
import shutil

from bench.common import emit, tmpdir, train

ALGOS = ("parle", "localsgd", "diloco", "elastic", "dpsgd")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    L = 25
    budget = ["data.train_limit=12800", "train.epochs=1"] if a.quick else ["train.epochs=1"]
    common = ["--config", "configs/fashion_parle.yaml", *budget, "eval.every=1000", "dist.threads=1",
              f"parle.sync_period={L}", f"localsgd.sync_period={L}", f"diloco.sync_period={L}", f"train.block={L}"]
    d = tmpdir("comm")
    per = {}
    for algo in ALGOS:
        s = train([*common, f"algo={algo}"], run_dir=d / algo)
        per[algo] = s
        emit(f"comm_{algo}_bytes_per_sample", s["bytes_communicated"] / s["samples_seen"])
        emit(f"comm_{algo}_allreduce_calls_per_sample", s["allreduce_calls"] / s["samples_seen"])
        emit(f"comm_{algo}_allreduce_calls", s["allreduce_calls"])
    b = {k: v["bytes_communicated"] / v["samples_seen"] for k, v in per.items()}
    emit("bytes_per_sample_ratio", b["parle"] / b["dpsgd"])
    emit("bytes_per_sample_target", 1 / L)
    emit("bytes_per_sample_target_met", int(b["parle"] / b["dpsgd"] <= 1 / L))
    # what the sync carries beyond dpsgd's gradients: BatchNorm statistics, schedule, slots
    p = per["parle"]
    eval_bytes = 8 * (3 + 2 * p["world_size"])      # float64 sums + two slots per replica
    sync_bytes = (p["allreduce_bytes"] - p["evaluations"] * eval_bytes) / (p["outer_steps"] + 1)
    emit("parle_sync_bytes_over_weight_bytes", sync_bytes / (4 * p["params"]))
    emit("calls_per_sample_ratio", (per["parle"]["allreduce_calls"] / per["parle"]["samples_seen"])
         / (per["dpsgd"]["allreduce_calls"] / per["dpsgd"]["samples_seen"]))
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
