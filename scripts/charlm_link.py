"""Issue 22: wall time to dpsgd's final validation loss for examples/charlm, on loopback and
between the two network-namespace hosts of tools/netlab.py at 10 Mbit, side by side in one run.

    python scripts/charlm_link.py [--links loopback,10mbit] [--out reports/charlm_link]

Per link, seed 42, one run each (in this order): dpsgd as a Horovod expert would run it
(fp16 compression, 128 MB fusion, 5 ms cycle: the claims' tuned setting), then parle,
localsgd and diloco with examples/charlm/charlm.yaml as it is. The target is that link's
dpsgd run's final validation loss; the time is training time (evaluation left out) at the
first evaluation at or below it. The losses over 3 seeds are docs/results/charlm.md's (the
compare sweep on loopback). Resumable: a run with a summary.json is reused. Writes
OUT/links.json and prints ``name: value`` lines. Needs root (network namespaces) for 10 Mbit.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import emit  # noqa: E402
from parle_hvd.compare import load_metrics  # noqa: E402
from rq1_speed import Link, cached_train  # noqa: E402

CONFIG = "examples/charlm/charlm.yaml"
ALGOS = {"dpsgd": ["algo=dpsgd", "dpsgd.fp16=true"], "parle": ["algo=parle"], "localsgd": ["algo=localsgd"],
         "diloco": ["algo=diloco"]}


def to_loss(run_dir: Path, target: float):
    """(training seconds, passes) at the first evaluation whose validation loss is at or
    below ``target``; (None, None) if none is."""
    m = next((m for m in load_metrics(run_dir) if m.get("valid/loss") is not None and m["valid/loss"] <= target + 1e-12),
             None)
    if m is None:
        return None, None
    return m["train/wall_seconds"] - m.get("train/eval_seconds", 0.0), m["train/passes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/charlm_link.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="loopback,10mbit")
    ap.add_argument("--out", default="reports/charlm_link")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()          # the ranks on the lab's hosts share this filesystem
    res = {}
    for link in [x for x in a.links.split(",") if x]:
        runs = {}
        with Link(link) as ln:
            for algo, extra in ALGOS.items():
                runs[algo] = cached_train(["--config", CONFIG, *extra, "train.seed=42", "dist.threads=1"],
                                          out / link / algo, ln.launcher(5.0))
        target = runs["dpsgd"]["valid_loss"]
        res[link] = {"target_valid_loss": target, "runs": {}}
        for algo, s in runs.items():
            t, p = to_loss(out / link / algo, target)
            train = s["wall_seconds"] - s["eval_seconds"]
            res[link]["runs"][algo] = {"final_valid_loss": s["valid_loss"], "train_seconds": train,
                                       "to_target_seconds": t, "to_target_passes": p,
                                       "mb": s["bytes_communicated"] / 1e6}
            emit(f"charlm_{link}_{algo}_train_seconds", round(train, 2))
            emit(f"charlm_{link}_{algo}_to_dpsgd_valid_loss_seconds", None if t is None else round(t, 2))
        d = res[link]["runs"]["dpsgd"]["to_target_seconds"]
        for algo, r in res[link]["runs"].items():
            r["ratio_to_dpsgd"] = r["to_target_seconds"] / d if r["to_target_seconds"] and d else None
            emit(f"charlm_{link}_{algo}_ratio_to_dpsgd", None if r["ratio_to_dpsgd"] is None else round(r["ratio_to_dpsgd"], 3))
    out.mkdir(parents=True, exist_ok=True)
    (out / "links.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
