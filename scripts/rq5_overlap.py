"""Issue 13 / the paper's RQ5, part 1: Parle's sync overlapped with the next inner loop
(parle.overlap) against the blocking sync and against dpsgd at its best, 2 ranks, on
loopback and between the two network-namespace hosts of tools/netlab.py at 100 and 10 Mbit.

    python scripts/rq5_overlap.py [--seeds 3] [--links loopback,100mbit,10mbit] [--out reports/rq5/overlap]

Per link, side by side in this one run (the order: dpsgd, parle blocking, parle overlapped):
dpsgd with the setting scripts/rq1_speed.py tuned on the 10 Mbit link (fp16 compression,
Horovod cycle time, fusion 128 MB; reports/rq1/tune.json, tuned again if missing) for 4
passes, and Parle for 8 passes with parle.init=broadcast (the claims' choice), blocking and
overlapped. The budgets and the target are RQ1's: the time to dpsgd's final test accuracy,
training time only (evaluation left out), at the first evaluation at or above it.

Reported per link and run: seconds per outer step (training seconds / outer steps; an
evaluating or checkpointing step drains its own sync, so it is in there too), and the
time to the target and its ratio to dpsgd's. Timing is seed 42 on every link (one run
each); the final test error is compared over --seeds seeds on loopback (Parle's runs are
deterministic given the seed, so the links would repeat it).

Resumable: a run with a summary.json is reused. Writes OUT/overlap.json and prints
``name: value`` lines. Needs root (network namespaces) for the throttled links.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import emit  # noqa: E402
from parle_hvd.compare import mean_ci, paired  # noqa: E402
from rq1_speed import CONFIG, Link, budget, cached_train, to_target, tune  # noqa: E402

DPSGD_PASSES, PARLE_PASSES = 4, 8


def _row(s: dict, run_dir: Path, target: float, dpsgd_t) -> dict:
    t, w, p = to_target(run_dir, target)
    train = s["wall_seconds"] - s["eval_seconds"]
    return {"final_accuracy": s["test_accuracy"], "train_seconds": train, "wall_seconds": s["wall_seconds"],
            "outer_steps": s["outer_steps"], "seconds_per_outer_step": train / s["outer_steps"],
            "to_target_seconds": t, "to_target_passes": p, "ratio_to_dpsgd": t / dpsgd_t if t and dpsgd_t else None,
            "overlapped_syncs": s.get("overlapped_syncs"), "mb": s["bytes_communicated"] / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/rq5_overlap.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--links", default="loopback,100mbit,10mbit")
    ap.add_argument("--tune", default="reports/rq1", help="where rq1_speed.py's tune.json is (or goes)")
    ap.add_argument("--out", default="reports/rq5/overlap")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()          # the ranks on the lab's hosts share this filesystem
    out.mkdir(parents=True, exist_ok=True)
    links = [x for x in a.links.split(",") if x]
    t = tune(Path(a.tune).resolve(), "10mbit")
    emit("rq5_dpsgd_setting", f"{t['best']} (fp16={t['fp16']}, cycle {t['cycle_ms']} ms, fusion 128 MB)")
    dp = ["algo=dpsgd", f"dpsgd.fp16={str(t['fp16']).lower()}"]
    pa = ["algo=parle", "parle.init=broadcast"]
    res = {"config": CONFIG, "dpsgd_passes": DPSGD_PASSES, "parle_passes": PARLE_PASSES, "tuning": t, "links": {},
           "accuracy": {}}

    def save():
        (out / "overlap.json").write_text(json.dumps(res, indent=2))

    for link in links:
        seeds = range(42, 42 + (a.seeds if link == "loopback" else 1))
        with Link(link) as ln:
            for seed in seeds:
                sd_dir = out / link / f"dpsgd-s{seed}"
                sd = cached_train(["--config", CONFIG, *budget(DPSGD_PASSES), f"train.seed={seed}", *dp], sd_dir,
                                  ln.launcher(t["cycle_ms"]))
                target = sd["test_accuracy"]
                dt, _, _ = to_target(sd_dir, target)
                row = {"target": target, "dpsgd": {**_row(sd, sd_dir, target, dt)}}
                for name, extra in (("blocking", "parle.overlap=false"), ("overlap", "parle.overlap=true")):
                    d = out / link / f"parle-{name}-s{seed}"
                    s = cached_train(["--config", CONFIG, *budget(PARLE_PASSES), f"train.seed={seed}", *pa, extra], d,
                                     ln.launcher(1.0))
                    row[name] = _row(s, d, target, dt)
                    r = row[name]["ratio_to_dpsgd"]
                    emit(f"rq5_{link}_s{seed}_{name}_seconds_per_outer_step", row[name]["seconds_per_outer_step"])
                    emit(f"rq5_{link}_s{seed}_{name}_time_ratio_to_dpsgd", r if r is not None else "never")
                res["links"].setdefault(link, {})[str(seed)] = row
                save()
    # final test error over the seeds (loopback), overlapped vs blocking
    rows = res["links"].get("loopback", {})
    if rows:
        err = {n: {s: 100 * (1 - rows[s][n]["final_accuracy"]) for s in rows} for n in ("blocking", "overlap")}
        m, h, _ = mean_ci(list(err["overlap"].values()))
        mb, hb, _ = mean_ci(list(err["blocking"].values()))
        d, dh, _, word = paired(err["blocking"], err["overlap"])
        res["accuracy"] = {"seeds": sorted(rows), "test_error": err, "overlap": [m, h], "blocking": [mb, hb],
                           "paired_blocking_minus_overlap": [d, dh, word],
                           "overlap_within_blocking_interval": abs(m - mb) <= hb if hb == hb else None}
        emit("rq5_overlap_test_error", f"{m:.2f} ± {h:.2f} % (blocking {mb:.2f} ± {hb:.2f} %)")
    # seconds per outer step at 10 Mbit against loopback (the 10 % target)
    if "loopback" in res["links"] and "10mbit" in res["links"]:
        lo = res["links"]["loopback"]["42"]["overlap"]["seconds_per_outer_step"]
        hi = res["links"]["10mbit"]["42"]["overlap"]["seconds_per_outer_step"]
        res["overlap_step_10mbit_over_loopback"] = hi / lo
        emit("rq5_overlap_step_seconds_10mbit_over_loopback", hi / lo)
    save()
    emit("rq5_overlap_written", str(out / "overlap.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
