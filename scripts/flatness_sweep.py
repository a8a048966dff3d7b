"""The paper's RQ4 (flat minima) over a compare report's runs: the flatness of each final
model (parle_hvd.flatness: the mean rise in training loss under filter-normalised Gaussian
perturbations, Li et al. 2018) and its final replica spread, one JSON line per run.

    python scripts/flatness_sweep.py reports/rq2_full --algos parle,sgd --out reports/rq4/flatness.jsonl

Resumable: runs already in OUT are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parle_hvd.flatness import measure_run  # noqa: E402

SIZES = (0.05, 0.1, 0.2, 0.4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/flatness_sweep.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--algos", default="parle,sgd")
    ap.add_argument("--out", required=True)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--batches", type=int, default=20)
    a = ap.parse_args(argv)
    runs = Path(a.report) / "runs"
    if not runs.is_dir():
        print(f"error: {a.report}: no runs/ folder (run the compare sweep first)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(l)["run"] for l in out.read_text().splitlines() if l.strip()} if out.is_file() else set()
    for algo in a.algos.split(","):
        for d in sorted(runs.glob(f"{algo}-s*")):
            if not d.is_dir() or str(d) in done or not (d / "final.pt").is_file():
                continue
            r = measure_run(d, sizes=SIZES, draws=a.draws, batches=a.batches)
            with out.open("a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"[flatness] {d.name}: base {r['base_loss']:.4f}, rise {r['rise']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
