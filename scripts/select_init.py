"""Choose Parle's replica initialisation on the validation split, before the claims' runs:
independent (seed + rank, PARLE.md's default) or broadcast (every replica starts from rank
0's weights, as local SGD, DiLoCo and dpsgd do). The small-data regime of RQ2 (6000 images,
20 passes, no augmentation, 10 % held out), 3 seeds each; the lower mean final validation
error wins (the test set is not read). Prints the choice; writes OUT/choice.json.

    python scripts/select_init.py [--seeds 3] [--out reports/select_init]

The runs go to reports/rq2_small/runs (compare's cache), so the chosen variant's runs are
reused by the RQ2 small-data sweep. Resumable like every compare call.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from parle_hvd.compare import mean_ci, paired  # noqa: E402

SMALL = ["data.train_limit=6000", "data.val_frac=0.1", "data.augment=false", "dist.threads=1"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/select_init.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="reports/select_init")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    valid, test, cmds = {}, {}, {}
    for init in ("independent", "broadcast"):
        cmd = [sys.executable, "-m", "parle_hvd.compare", "--config", "configs/fashion_parle.yaml", "--algos", "parle",
               "--np", "2", "--seeds", str(a.seeds), "--name", "rq2_small", *SMALL, f"parle.init={init}"]
        cmds[init] = "python " + " ".join(cmd[1:])
        print(f"[select_init] {cmds[init]}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        shutil.copy(ROOT / "reports" / "rq2_small" / "summary.json", out / f"{init}.json")
        runs = json.loads((out / f"{init}.json").read_text())["parle"]
        valid[init] = {int(s): 1 - r["valid_accuracy"] for s, r in runs.items()}
        test[init] = {int(s): 1 - r["test_accuracy"] for s, r in runs.items()}
    mv = {k: mean_ci(list(v.values())) for k, v in valid.items()}
    choice = min(mv, key=lambda k: (mv[k][0], k != "independent"))      # a tie keeps PARLE.md's default
    d = paired(valid["independent"], valid["broadcast"])                  # independent - broadcast
    res = {"choice": choice, "rule": "lower mean final validation error over the seeds",
           "valid_error": {k: {"mean": m, "half_width": h, "n": n, "per_seed": valid[k]} for k, (m, h, n) in mv.items()},
           "test_error_reported_only": test,
           "paired_independent_minus_broadcast": {"mean": d[0], "half_width": d[1], "n": d[2],
                                                  "verdict_for_broadcast": d[3]},
           "commands": cmds}
    (out / "choice.json").write_text(json.dumps(res, indent=2))
    print(f"[select_init] validation error: independent {100 * mv['independent'][0]:.2f} %, broadcast "
          f"{100 * mv['broadcast'][0]:.2f} %: parle.init={choice}", file=sys.stderr, flush=True)
    print(choice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
