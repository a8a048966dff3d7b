"""Shared helpers for the benchmarks: ``name: value`` output, runs of the real trainer
under a launcher, and reading their outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(Path(sys.executable))
VENV_BIN = str(Path(sys.executable).parent)
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def emit(name: str, value, unit: str = "") -> None:
    """One figure: ``name: value`` (the format every benchmark prints)."""
    if isinstance(value, float):
        value = f"{value:.4g}"
    print(f"{name}: {value}{(' ' + unit) if unit else ''}", flush=True)


def train(args, *, np: int = 2, run_dir: Path, env: dict | None = None, launcher: list | None = None,
          timeout: float = 3600) -> dict:
    """Run train.py on ``np`` local ranks (horovodrun --gloo) or with ``launcher``; return summary.json."""
    e = {**os.environ, **MPI_ENV, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", **(env or {})}
    if launcher is None:
        launcher = ([f"{VENV_BIN}/horovodrun", "--gloo", "-np", str(np), "-H", f"localhost:{np}"] if np > 1 else [])
    cmd = [*launcher, PY, "train.py", *map(str, args), f"run.dir={run_dir}", "run.progress=lines"]
    r = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir: Path) -> list:
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]


def first_reaching(run_dir: Path, target: float):
    """The first evaluation (its metrics.jsonl row) at which the reference reached ``target``
    test accuracy, or None if none did."""
    return next((m for m in metrics(run_dir) if m.get("val/accuracy") is not None and m["val/accuracy"] >= target),
                None)


def time_to_accuracy(run_dir: Path, target: float):
    """Training wall seconds until the reference first reached ``target`` test accuracy
    (None if it never did), from the evaluations in metrics.jsonl."""
    m = first_reaching(run_dir, target)
    return m["train/wall_seconds"] if m else None


def tmpdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"parle_bench_{prefix}_"))
