#!/usr/bin/env python3
"""The default preset trained twice, once through each engine, and the two runs compared
(issue 15: torchrun must train to make run's val_accuracy within 0.3 points and write the
same outputs). Runs both, one after the other, unless given two finished run directories:

    python scripts/engines_run.py [--reuse HVD_RUN_DIR TORCH_RUN_DIR]

    make run ARGS=run.dir=HVD_RUN_DIR                                   # Horovod (horovodrun --gloo)
    torchrun --nproc-per-node 2 train.py --config configs/fashion_parle.yaml run.dir=TORCH_RUN_DIR

Prints `name: value` lines (docs/results/engines_run.txt, rendered by write_results.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def outputs(d: Path) -> list:
    """What a run wrote, by name (checkpoint steps and TensorBoard files by kind, not by
    their timestamped names)."""
    names = set()
    for p in d.rglob("*"):
        if not p.is_file() or ".heartbeat" in p.parts:
            continue
        rel = p.relative_to(d)
        if rel.parts[0] == "tb":
            names.add("tb/" + ("events.out.tfevents.*" if p.name.startswith("events.out") else p.name))
        else:
            names.add(str(rel))
    return sorted(names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reuse", nargs=2, metavar=("HVD_RUN", "TORCH_RUN"))
    ap.add_argument("--out", default="/tmp/parle_engines_run")
    a = ap.parse_args()
    if a.reuse:
        hvd, tor = map(Path, a.reuse)
    else:
        hvd, tor = Path(a.out) / "horovod", Path(a.out) / "torch"
        subprocess.run(["make", "run", f"ARGS=run.dir={hvd}"], cwd=ROOT, check=True)
        subprocess.run([str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "train.py", "--config",
                        "configs/fashion_parle.yaml", f"run.dir={tor}"], cwd=ROOT, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    sh, st = (json.loads((d / "summary.json").read_text()) for d in (hvd, tor))
    print(f"engines_run_commands: make run ARGS=run.dir={hvd} ; torchrun --nproc-per-node 2 train.py "
          f"--config configs/fashion_parle.yaml run.dir={tor}")
    for tag, s in (("horovod", sh), ("torch", st)):
        print(f"engines_run_{tag}_engine: {s['engine']} {s['controller']}")
        print(f"engines_run_{tag}_val_accuracy: {s['val_accuracy']}")
        print(f"engines_run_{tag}_wall_seconds: {s['wall_seconds']:.1f}")
        print(f"engines_run_{tag}_allreduce_calls: {s['allreduce_calls']}")
        print(f"engines_run_{tag}_bytes: {s['bytes_communicated']}")
    diff = 100 * (st["val_accuracy"] - sh["val_accuracy"])
    print(f"engines_run_val_accuracy_difference_points: {diff:.4f}")
    print(f"engines_run_within_target: {int(abs(diff) <= 0.3)}")
    oh, ot = outputs(hvd), outputs(tor)
    print(f"engines_run_same_outputs: {int(oh == ot)}")
    if oh != ot:
        print(f"engines_run_outputs_only_horovod: {sorted(set(oh) - set(ot))}")
        print(f"engines_run_outputs_only_torch: {sorted(set(ot) - set(oh))}")
    fh, ft = torch.load(hvd / "final.pt"), torch.load(tor / "final.pt")
    same = fh.keys() == ft.keys() and all(torch.equal(fh[k], ft[k]) for k in fh)
    print(f"engines_run_final_bit_identical: {int(same)}")


if __name__ == "__main__":
    main()
