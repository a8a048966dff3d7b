"""parle_hvd.compare: the statistics against closed forms, and a smoke of --seeds through
the real trainer (two seeds of two algorithms, cached on the second call)."""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multirank import ROOT, MPI_ENV
from parle_hvd.compare import mean_ci, paired

FASHION = Path("/usr/share/datasets/fashion-mnist")


def test_mean_and_student_t_interval():
    m, h, n = mean_ci([1.0, 2.0, 3.0, 4.0])
    # sd = sqrt(5/3), t(0.975, 3) = 3.182446305284263
    assert n == 4 and m == 2.5 and h == pytest.approx(3.182446305284263 * math.sqrt(5 / 3) / 2, rel=1e-12)
    m, h, n = mean_ci([0.3])
    assert (m, n) == (0.3, 1) and math.isnan(h)
    assert mean_ci([None, float("nan")])[2] == 0


def test_paired_difference_and_verdict():
    parle = {1: 0.10, 2: 0.11, 3: 0.12}
    worse_baseline = {1: 0.13, 2: 0.14, 3: 0.15}     # always 3 points higher: Parle better
    m, h, n, v = paired(worse_baseline, parle)
    assert n == 3 and m == pytest.approx(0.03) and h == pytest.approx(0.0, abs=1e-12) and v == "better"
    assert paired(parle, worse_baseline)[3] == "worse"
    noisy = {1: 0.12, 2: 0.09, 3: 0.13}
    assert paired(noisy, parle)[3] == "no difference"
    assert paired({1: 0.2, 9: 0.3}, parle)[3] == "n/a (one seed)"       # only seed 1 is shared


@pytest.mark.multirank
@pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")
def test_compare_with_seeds_reports_intervals_and_reuses_finished_runs(tmp_path):
    cmd = [sys.executable, "-m", "parle_hvd.compare", "--config", "configs/fashion_parle.yaml", "--algos",
           "parle,sgd", "--np", "2", "--seeds", "2", "--name", "smoke", "--reports", str(tmp_path),
           "train.epochs=1", "data.train_limit=2560", "data.test_limit=500", "data.val_frac=0.1",
           "parle.sync_period=5", "train.batch_size=64", "eval.every=0.5", "eval.bn_batches=2", "dist.threads=1"]
    env = {**__import__("os").environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "smoke"
    rep = (out / "report.md").read_text()
    assert "| parle | 2 | 2 |" in rep and "| sgd | 1 | 2 |" in rep and " ± " in rep
    assert "| sgd (n=2) |" in rep and any(v in rep for v in ("better", "worse", "no difference"))
    runs = sorted(p.name for p in (out / "runs").iterdir() if p.is_dir())
    assert [r_.split("-")[0] + "-" + r_.split("-")[1] for r_ in runs] == ["parle-s42", "parle-s43", "sgd-s42", "sgd-s43"]
    s = json.loads((out / "summary.json").read_text())
    assert s["parle"]["42"]["config"]["train"]["seed"] == 42 and s["parle"]["43"]["config"]["train"]["seed"] == 43
    assert s["parle"]["42"]["val_accuracy"] != s["parle"]["43"]["val_accuracy"]
    assert all(math.isfinite(s[a][k]["valid_accuracy"]) for a in s for k in s[a])
    assert len(list((out / "hparams").iterdir())) == 4
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.count("cached") == 4, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30
    assert (out / "report.md").read_text().count("±") == rep.count("±")
