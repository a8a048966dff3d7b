"""Issue 13 / the paper's RQ5, part 2: replicas of unequal speed. 3 ranks on this 2-core
machine, ranks 0 and 1 pinned to core 0 and rank 2 alone on core 1 (taskset through
tools/pin.sh: a real 2x speed difference, no injected sleeps), each rank one torch thread.

    python scripts/rq5_hetero.py [--seeds 1] [--pin 0,0,1] [--out reports/rq5/hetero]

Side by side in this one run, per seed: dpsgd (3 ranks, the setting scripts/rq1_speed.py
tuned: fp16 compression and Horovod's cycle time, fusion 128 MB) for 4 passes; Parle
(parle.init=broadcast) for 8 passes with parle.balance=off, then with parle.balance=time
(rank 0 gives each replica a share of the 3*L inner steps in proportion to its measured
speed). Reported: samples per second over the training time (evaluation left out), the
ratio balance on / off (ideal 4/3 for speeds 1/2, 1/2, 1), the time to dpsgd's final test
accuracy, and the inner steps each replica was given in the last outer step.

Resumable: a run with a summary.json is reused. Writes OUT/hetero.json and prints
``name: value`` lines.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import ROOT, VENV_BIN, emit, metrics  # noqa: E402
from rq1_speed import CONFIG, budget, cached_train, to_target, tune  # noqa: E402

DPSGD_PASSES, PARLE_PASSES = 4, 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/rq5_hetero.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--pin", default="0,0,1", help="the core of each rank (PARLE_PIN of tools/pin.sh)")
    ap.add_argument("--tune", default="reports/rq1", help="where rq1_speed.py's tune.json is (or goes)")
    ap.add_argument("--out", default="reports/rq5/hetero")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import os
    os.environ["PARLE_PIN"] = a.pin                      # read by tools/pin.sh on every rank
    np_ = len(a.pin.split(","))
    t = tune(Path(a.tune).resolve(), "10mbit")

    def launcher(cycle_ms: float) -> list:
        return [f"{VENV_BIN}/horovodrun", "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
                "--cycle-time-ms", str(cycle_ms), "--fusion-threshold-mb", "128", str(ROOT / "tools/pin.sh")]

    res = {"config": CONFIG, "pin": a.pin, "ranks": np_, "dpsgd_passes": DPSGD_PASSES, "parle_passes": PARLE_PASSES,
           "tuning": t, "seeds": {}}
    for seed in range(42, 42 + a.seeds):
        sd_dir = out / f"dpsgd-s{seed}"
        sd = cached_train(["--config", CONFIG, *budget(DPSGD_PASSES), f"train.seed={seed}", "algo=dpsgd",
                           f"dpsgd.fp16={str(t['fp16']).lower()}"], sd_dir, launcher(t["cycle_ms"]))
        target = sd["test_accuracy"]
        dt, _, _ = to_target(sd_dir, target)
        row = {"target": target, "dpsgd": {"train_seconds": sd["wall_seconds"] - sd["eval_seconds"],
                                           "samples_per_sec": sd["samples_seen"] / (sd["wall_seconds"] - sd["eval_seconds"]),
                                           "to_target_seconds": dt}}
        for name in ("off", "time"):
            d = out / f"parle-balance-{name}-s{seed}"
            args = ["--config", CONFIG, *budget(PARLE_PASSES), f"train.seed={seed}", "algo=parle",
                    "parle.init=broadcast", f"parle.balance={name}", "run.log_every=1"]
            if name == "off":        # the default, left out: before config.py read a bare "off" as YAML does (False)
                args.remove("parle.balance=off")
            s = cached_train(args, d, launcher(1.0))
            train_s = s["wall_seconds"] - s["eval_seconds"]
            tt, _, tp = to_target(d, target)
            last = [m for m in metrics(d) if "balance/inner_steps/0" in m]
            row[name] = {"train_seconds": train_s, "samples_per_sec": s["samples_seen"] / train_s,
                         "final_accuracy": s["test_accuracy"], "to_target_seconds": tt, "to_target_passes": tp,
                         "ratio_to_dpsgd": tt / dt if tt and dt else None,
                         "last_inner_steps": [last[-1][f"balance/inner_steps/{r}"] for r in range(np_)] if last else None}
            emit(f"rq5_hetero_s{seed}_balance_{name}_samples_per_sec", row[name]["samples_per_sec"])
            emit(f"rq5_hetero_s{seed}_balance_{name}_to_target_seconds", tt if tt is not None else "never")
        row["samples_per_sec_ratio"] = row["time"]["samples_per_sec"] / row["off"]["samples_per_sec"]
        emit(f"rq5_hetero_s{seed}_samples_per_sec_balance_on_over_off", row["samples_per_sec_ratio"])
        res["seeds"][str(seed)] = row
        (out / "hetero.json").write_text(json.dumps(res, indent=2))
    emit("rq5_hetero_written", str(out / "hetero.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
