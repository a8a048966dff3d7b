"""The paper's RQ3 on Fashion-MNIST: Parle with n=3 replicas each seeing 1/3 of the data vs
SGD on one third vs SGD on all of it; and Parle n=2 with 1/2 each vs SGD on one half. The
same budget in passes over each replica's (or SGD's) data.

    python -m bench.split_data [--quick] [--passes 8]
"""
from __future__ import annotations

import argparse
import shutil

from bench.common import emit, tmpdir, train


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--passes", type=float, default=8)
    a = ap.parse_args(argv)
    p = 2 if a.quick else a.passes
    common = ["--config", "configs/fashion_parle.yaml", f"train.epochs={p}", "eval.every=1000",
              f"optim.milestones=[{round(0.6 * p, 2)},{round(0.85 * p, 2)}]"]
    if a.quick:
        common.append("data.train_limit=12000")
    d = tmpdir("split")
    rows = [("parle_n3_third", 3, ["algo=parle", "data.split=frac", "data.frac=0.3333333333"]),
            ("sgd_third", 1, ["algo=sgd", "data.split=frac", "data.frac=0.3333333333"]),
            ("parle_n2_half", 2, ["algo=parle", "data.split=frac", "data.frac=0.5"]),
            ("sgd_half", 1, ["algo=sgd", "data.split=frac", "data.frac=0.5"]),
            ("sgd_full", 1, ["algo=sgd"])]
    for name, n, over in rows:
        s = train([*common, *over, "dist.threads=1" if n > 1 else "dist.threads=0"], np=n, run_dir=d / name)
        emit(f"split_{name}_test_error_pct", 100 * (1 - s["val_accuracy"]))
        emit(f"split_{name}_wall_seconds", s["wall_seconds"])
        emit(f"split_{name}_ranks", n)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
