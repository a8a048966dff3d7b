"""The paper's RQ1 (speed): training wall time for Parle to reach the final test accuracy of
data-parallel SGD (dpsgd, Horovod's DistributedOptimizer) at its best, 2 ranks, on loopback
and between the two network-namespace hosts of tools/netlab.py throttled to 100 Mbit and to
10 Mbit, over several seeds.

    python scripts/rq1_speed.py [--seeds 3] [--passes 4] [--parle-passes 8] [--links loopback,100mbit,10mbit] [--out reports/rq1]

1. dpsgd is tuned first, the way a Horovod user would, on the slowest link: fp16
   compression off/on and Horovod's cycle time (0.2, 1 = default, 5 ms); the fusion
   threshold stays at Horovod's 128 MB, which holds the whole model, so every step's
   gradients travel as one fused buffer. The setting with the shortest training time for
   one pass wins (tune.json) and is used on every link.
2. Per link and seed s (train.seed = 42 + i): dpsgd (tuned) for --passes passes and parle
   for --parle-passes (default twice as many), each on the preset (configs/fashion_parle.yaml)
   with its schedule scaled to its own budget (lr x0.2 at 0.6 and 0.85 of it), evaluated
   every 0.5 pass. The target is that seed's dpsgd final test accuracy; the time to reach it
   is the training wall time at the first evaluation at or above it, with the time spent
   evaluating left out (train/eval_seconds), so that evaluating more often per second does
   not count against dpsgd. Parle's ratio = its time / dpsgd's time, per seed. Parle gets
   the longer budget because at equal passes its final accuracy is often just below
   dpsgd's (measured: 4 passes, seed 42, independent inits, 88.90 % against 89.32 %), which would make "time to
   dpsgd's accuracy" undefined rather than measured; the longer budget is only a ceiling,
   the clock stops at the first evaluation that reaches the target.

Resumable: a run with a summary.json is reused. Writes OUT/rq1.json and prints
``name: value`` lines. Needs root (network namespaces) for the throttled links.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import VENV_BIN, emit, first_reaching, train  # noqa: E402

CONFIG = "configs/fashion_parle.yaml"
TUNE = {"fp32_cycle1": (False, 1.0), "fp16_cycle1": (True, 1.0), "fp16_cycle0.2": (True, 0.2),
        "fp16_cycle5": (True, 5.0)}


def budget(passes: float) -> list:
    m1, m2 = round(0.6 * passes, 2), round(0.85 * passes, 2)
    return [f"train.epochs={passes}", "eval.every=0.5", f"optim.milestones=[{m1},{m2}]", "dist.threads=1"]


def to_target(run_dir: Path, target: float):
    """(training seconds, wall seconds, passes) at the first evaluation at or above ``target``
    test accuracy, evaluation time left out of the first; (None, None, None) if none is."""
    m = first_reaching(run_dir, target - 1e-12)
    if m is None:
        return None, None, None
    return m["train/wall_seconds"] - m.get("train/eval_seconds", 0.0), m["train/wall_seconds"], m["train/passes"]


def cached_train(args: list, run_dir: Path, launcher: list) -> dict:
    done = run_dir / "summary.json"
    if done.is_file():
        return json.loads(done.read_text())
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return train(args, run_dir=run_dir, launcher=launcher, timeout=3 * 3600)


class Link:
    """A launcher for 2 ranks: local horovodrun (loopback) or the two throttled hosts."""

    def __init__(self, name: str):
        self.name, self.lab = name, None

    def __enter__(self):
        if self.name != "loopback":
            from tools.netlab import TwoHosts
            self.lab = TwoHosts(rate=self.name).__enter__()
        return self

    def __exit__(self, *exc):
        if self.lab is not None:
            self.lab.__exit__(*exc)

    def launcher(self, cycle_ms: float) -> list:
        hr = f"{VENV_BIN}/horovodrun"
        base = (self.lab.horovodrun(hr) if self.lab is not None
                else [hr, "--gloo", "-np", "2", "-H", "localhost:2"])
        return [*base, "--cycle-time-ms", str(cycle_ms), "--fusion-threshold-mb", "128"]


def tune(out: Path, link: str) -> dict:
    f = out / "tune.json"
    if f.is_file():
        return json.loads(f.read_text())
    res = {}
    with Link(link) as ln:
        for name, (fp16, cyc) in TUNE.items():
            s = cached_train(["--config", CONFIG, "algo=dpsgd", f"dpsgd.fp16={str(fp16).lower()}",
                              "train.epochs=1", "eval.every=100", "optim.milestones=[]", "dist.threads=1"],
                             out / "tune" / name, ln.launcher(cyc))
            res[name] = {"fp16": fp16, "cycle_ms": cyc, "train_seconds": s["wall_seconds"] - s["eval_seconds"],
                         "bytes": s["bytes_communicated"]}
            emit(f"rq1_tune_{link}_{name}_train_seconds", res[name]["train_seconds"])
    best = min(res, key=lambda k: res[k]["train_seconds"])
    r = {"link": link, "candidates": res, "best": best, "fp16": res[best]["fp16"], "cycle_ms": res[best]["cycle_ms"]}
    f.write_text(json.dumps(r, indent=2))
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/rq1_speed.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--passes", type=float, default=4, help="dpsgd's budget")
    ap.add_argument("--parle-passes", type=float, default=0, help="parle's budget (0 = twice --passes)")
    ap.add_argument("--parle-init", default="independent", choices=("independent", "broadcast"),
                    help="parle.init (scripts/select_init.py chooses it on the validation split)")
    ap.add_argument("--links", default="loopback,100mbit,10mbit")
    ap.add_argument("--out", default="reports/rq1")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()          # the ranks on the lab's hosts share this filesystem
    out.mkdir(parents=True, exist_ok=True)
    links = [x for x in a.links.split(",") if x]
    t = tune(out, links[-1])
    emit("rq1_dpsgd_setting", f"{t['best']} (fp16={t['fp16']}, cycle {t['cycle_ms']} ms, fusion 128 MB)")
    dp = [f"dpsgd.fp16={str(t['fp16']).lower()}"]
    pp = a.parle_passes or 2 * a.passes
    result = {"passes": a.passes, "parle_passes": pp, "parle_init": a.parle_init, "config": CONFIG, "tuning": t, "links": {}}
    for link in links:
        rows = {}
        with Link(link) as ln:
            for i in range(a.seeds):
                seed = 42 + i
                pdir = out / link / f"parle-p{pp:g}-{a.parle_init}-s{seed}"
                sd = cached_train(["--config", CONFIG, *budget(a.passes), f"train.seed={seed}", "algo=dpsgd", *dp],
                                  out / link / f"dpsgd-s{seed}", ln.launcher(t["cycle_ms"]))
                sp = cached_train(["--config", CONFIG, *budget(pp), f"train.seed={seed}", "algo=parle",
                                   f"parle.init={a.parle_init}"], pdir,
                                  ln.launcher(1.0))
                target = sd["val_accuracy"]
                dt, dw, _ = to_target(out / link / f"dpsgd-s{seed}", target)
                pt, pw, pp_t = to_target(pdir, target)
                rows[seed] = {"target": target, "dpsgd_train_seconds": dt, "parle_train_seconds": pt,
                              "dpsgd_wall_to_target": dw, "parle_wall_to_target": pw,
                              "ratio": pt / dt if pt is not None and dt else None,
                              "dpsgd_final": sd["val_accuracy"], "parle_final": sp["val_accuracy"],
                              "dpsgd_wall": sd["wall_seconds"], "parle_wall": sp["wall_seconds"],
                              "dpsgd_mb": sd["bytes_communicated"] / 1e6, "parle_mb": sp["bytes_communicated"] / 1e6,
                              "parle_passes_to_target": pp_t}
                emit(f"rq1_{link}_s{seed}_ratio", rows[seed]["ratio"] if rows[seed]["ratio"] is not None else "never")
                (out / "rq1.json").write_text(json.dumps({**result, "links": {**result["links"], link: rows}},
                                                         indent=2))
        result["links"][link] = rows
    (out / "rq1.json").write_text(json.dumps(result, indent=2))
    emit("rq1_written", str(out / "rq1.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
