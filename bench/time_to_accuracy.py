"""Time to accuracy: wall seconds for parle, localsgd and diloco to reach the final test
accuracy of data-parallel SGD (dpsgd), 2 ranks on Fashion-MNIST, same budget in passes, on
loopback and across the two throttled network-namespace hosts of tools/netlab.py.

    python -m bench.time_to_accuracy [--quick] [--passes 8] [--rate 100mbit] [--reuse DIR]

--reuse DIR takes the loopback runs from a `python -m parle_hvd.compare` report's runs/
folder instead of running them again (scripts/results.sh does that).
targets: tta_ratio_loopback (parle / dpsgd) <= 0.5, tta_ratio_throttled <= 0.25
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from bench.common import emit, time_to_accuracy, tmpdir, train

ALGOS = ("dpsgd", "parle", "localsgd", "diloco")


def budget(quick: bool, passes: float) -> list:
    if quick:
        return ["data.train_limit=12800", "train.epochs=2", "eval.every=0.25", "optim.milestones=[]"]
    m1, m2 = round(0.6 * passes, 2), round(0.85 * passes, 2)
    return [f"train.epochs={passes}", "eval.every=0.5", f"optim.milestones=[{m1},{m2}]"]


def figures(tag: str, runs: dict) -> None:
    target = runs["dpsgd"][1]["val_accuracy"]
    emit(f"tta_{tag}_target_accuracy", target)
    tta = {}
    for algo, (d, s) in runs.items():
        tta[algo] = time_to_accuracy(d, target)
        emit(f"tta_{tag}_{algo}_seconds", tta[algo] if tta[algo] is not None else "never")
        emit(f"tta_{tag}_{algo}_final_accuracy", s["val_accuracy"])
        emit(f"tta_{tag}_{algo}_wall_seconds", s["wall_seconds"])
    for algo in runs:
        if algo != "dpsgd":
            r = (tta[algo] / tta["dpsgd"]) if tta[algo] is not None and tta["dpsgd"] else None
            emit(f"tta_ratio_{tag}" + ("" if algo == "parle" else f"_{algo}"), r if r is not None else "never")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--passes", type=float, default=8)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--reuse", default="")
    ap.add_argument("--no-throttled", action="store_true")
    a = ap.parse_args(argv)
    common = ["--config", "configs/fashion_parle.yaml", "dist.threads=1", *budget(a.quick, a.passes)]
    d = tmpdir("tta")
    algos = ALGOS[:2] if a.quick else ALGOS

    runs = {}
    for algo in algos:
        done = sorted(Path(a.reuse).glob(f"{algo}-s*/summary.json")) if a.reuse else []
        if done:      # the compare report's first seed of this algorithm
            import json
            runs[algo] = (done[0].parent, json.loads(done[0].read_text()))
        else:
            runs[algo] = (d / f"loop-{algo}", train([*common, f"algo={algo}"], run_dir=d / f"loop-{algo}"))
    figures("loopback", runs)

    if not (a.quick or a.no_throttled):
        from tools.netlab import TwoHosts
        with TwoHosts(rate=a.rate) as lab:
            emit("tta_throttled_rate", a.rate)
            launcher = lab.horovodrun(str(Path(__import__("sys").executable).parent / "horovodrun"))
            runs = {algo: (d / f"thr-{algo}", train([*common, f"algo={algo}"], run_dir=d / f"thr-{algo}",
                                                      launcher=launcher)) for algo in algos}
            figures("throttled", runs)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
