#!/usr/bin/env python
"""Paired comparison of one algorithm's two variants, each a `parle_hvd.compare` report
run on the same seeds: the validation error (what selects), the test error (only
reported) and the final replica spread, with 95 % Student-t intervals.

    python scripts/variant_diff.py reports/scoping_number reports/scoping_auto [--algo parle]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parle_hvd.compare import _fmt, mean_ci, paired  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--algo", default="parle")
    o = ap.parse_args()
    runs = [json.loads((Path(d) / "summary.json").read_text())[o.algo] for d in (o.a, o.b)]
    na, nb = Path(o.a).name, Path(o.b).name
    print(f"| figure | {na} | {nb} | paired {na} - {nb} (points) | verdict for {na} |")
    print("|---|---|---|---|---|")
    for key, label in (("valid_accuracy", "final validation error (%)"), ("test_accuracy", "final test error (%)")):
        ea, eb = ({s: 1 - v[key] for s, v in r.items()} for r in runs)
        m, h, n, v = paired(eb, ea)             # b - a > 0: a's error is lower
        print(f"| {label}, n={n} | {_fmt(*mean_ci(list(ea.values()))[:2], 100)} | "
              f"{_fmt(*mean_ci(list(eb.values()))[:2], 100)} | {_fmt(-m, h, 100)} | {v} |")
    da, db = ([v["final_replica_distance"] for v in r.values()] for r in runs)
    print(f"| final replica spread, norm of x_a - xbar | {_fmt(*mean_ci(da)[:2], 1, 4)} | {_fmt(*mean_ci(db)[:2], 1, 4)} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
