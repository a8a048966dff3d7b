"""Launch a script on several ranks from pytest, collect each rank's JSON result, and
never let a hang eat the CI budget.

    results = run_ranks("tests/ranks/comm_check.py", controller="gloo", np=2)
    results[0]["..."]      # what rank 0 passed to report()

Controllers: "gloo" (horovodrun --gloo, started as tests/horovodrun_unprobed.py: Horovod's launcher
without its per-launch probe of the build) and "mpi" (mpirun) run Horovod's engine;
"torchrun" (torchrun --standalone) and "mpi-torch" (mpirun with PARLE_HVD_ENGINE=torch)
run torch.distributed's. ENGINE_OF names each one's engine.

A rank script calls ``report(obj)`` (from ``tests/ranks/_rank.py``) which writes
``$PARLE_TEST_OUT/rank<r>.json``. The launcher runs in its own session; on timeout the
whole process tree (launcher, its ssh/exec helpers, every rank, and anything in their
process groups) is killed, and ``MultiRankError`` carries every rank's output.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           # No InfiniBand/openib here; keep OpenMPI quiet and on TCP/shared memory.
           "OMPI_MCA_btl": "^openib", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


class MultiRankError(AssertionError):
    pass


ENGINE_OF = {"gloo": "horovod", "mpi": "horovod", "torchrun": "torch", "mpi-torch": "torch"}


def horovod_installed() -> bool:
    """Whether this venv has Horovod (``PARLE_HVD_ENGINE=torch make setup`` skips it)."""
    import importlib.util
    return importlib.util.find_spec("horovod") is not None


# What a test that does not name a controller runs under: Horovod's horovodrun --gloo, or
# torchrun in a setup without Horovod (PARLE_HVD_ENGINE=torch make setup).
DEFAULT = "gloo" if horovod_installed() else "torchrun"


def launcher_cmd(controller: str, np: int) -> list[str]:
    if controller == "torchrun":
        # --standalone: a local rendezvous on a free port; --no-python: the command follows
        # --tee 3 with RankJob's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: lines tagged "[rank]:"
        return [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(np), "--tee", "3", "--no-python"]
    if controller == "gloo":
        # horovodrun's own code, less the 1.8 s probe of the build it makes before each launch
        return [sys.executable, str(ROOT / "tests/horovodrun_unprobed.py"), "--gloo", "-np", str(np),
                "-H", f"localhost:{np}"]
    if controller in ("mpi", "mpi-torch"):
        return ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none", "--tag-output",
                "-x", "PATH", "-x", "PYTHONPATH", "-x", "PARLE_TEST_OUT", "-x", "OMPI_MCA_btl", "-x", "PARLE_HVD_ENGINE",
                "-x", "HOROVOD_STALL_CHECK_TIME_SECONDS", "-x", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]
    raise ValueError(controller)


def kill_tree(pid: int) -> None:
    """SIGKILL pid, all its descendants, and their process groups."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    pgids = set()
    for p in procs:
        try:
            pgids.add(os.getpgid(p.pid))
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for g in pgids:
        if g != os.getpgid(0):
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    psutil.wait_procs(procs, timeout=5)


def run_command(cmd, *, env: dict | None = None, timeout: float = 300, cwd=ROOT) -> tuple[int, str]:
    """Run any command (a launch script, say) in its own session; on timeout kill its whole
    tree and raise MultiRankError with its output."""
    e = dict(os.environ)
    e.update(MPI_ENV)
    if env:
        e.update(env)
    with tempfile.TemporaryFile() as fh:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=e,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            fh.seek(0)
            raise MultiRankError(f"{cmd[0]} timed out after {timeout:.0f}s and was killed; output:\n"
                                 f"{fh.read().decode(errors='replace')}")
        fh.seek(0)
        return rc, fh.read().decode(errors="replace")


class RankJob:
    """A launched multi-rank job: ``wait`` (kills the tree on timeout), ``kill``, ``output``."""

    def __init__(self, argv, *, controller: str = DEFAULT, np: int = 2, env: dict | None = None,
                 out_dir: Path | None = None, launcher_args=()):
        self.controller, self.np = controller, np
        self.out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="parle_mr_"))
        self.out.mkdir(parents=True, exist_ok=True)
        e = dict(os.environ)
        e.update(MPI_ENV)
        e["PARLE_TEST_OUT"] = str(self.out)
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), e.get("PYTHONPATH", "")])
        e["PATH"] = f"{VENV_BIN}{os.pathsep}{e['PATH']}"
        e.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "10")
        e.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30")
        if controller == "mpi-torch":
            e["PARLE_HVD_ENGINE"] = "torch"
        e.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:")
        if env:
            e.update(env)
        self.name = Path(str(argv[0])).name
        cmd = launcher_cmd(controller, np) + list(launcher_args) + [sys.executable, *map(str, argv)]
        self.log = self.out / "launcher.log"
        self._fh = open(self.log, "wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, cwd=ROOT, env=e,
                                     start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()
        self._fh.close()

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=max(0.1, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            self.kill()
            raise MultiRankError(
                f"{self.controller} job {self.name} timed out after {timeout:.0f}s and was killed;"
                f" output of every rank:\n{self.output}")
        self._fh.close()
        return rc


def run_ranks(script: str | Path, *, controller: str = DEFAULT, np: int = 2, args=(),
              timeout: float = 120.0, env: dict | None = None, out_dir: Path | None = None,
              expect_fail: bool = False, reports: bool = True) -> list[dict]:
    """Run ``script`` on ``np`` ranks; return the ranks' reports in rank order.

    Raises MultiRankError (with every rank's output) if the job times out, exits non-zero,
    or a rank wrote no report. With ``expect_fail`` a non-zero exit is returned as
    ``[{"_rc": rc, "_output": ...}]`` instead (timeouts still raise). With
    ``reports=False`` no rank reports are expected: ``[{"_rc": 0, "_output": ...}]``."""
    job = RankJob([script, *args], controller=controller, np=np, env=env, out_dir=out_dir)
    rc = job.wait(timeout)
    output = job.output
    if rc != 0:
        if expect_fail:
            return [{"_rc": rc, "_output": output, "_seconds": time.monotonic() - job.t0}]
        raise MultiRankError(f"{controller} job {job.name} exited {rc}; output:\n{output}")
    if not reports:
        return [{"_rc": 0, "_output": output, "_seconds": time.monotonic() - job.t0}]
    results = []
    for r in range(np):
        f = job.out / f"rank{r}.json"
        if not f.exists():
            raise MultiRankError(f"rank {r} wrote no report; output:\n{output}")
        results.append(json.loads(f.read_text()))
    if out_dir is None:
        shutil.rmtree(job.out, ignore_errors=True)
    return results


def run_sweep(runs, *, run_env=None, **kw) -> list[dict]:
    """Several train.py command lines (each a list starting with ``--config``) as one job:
    tests/ranks/sweep_rank.py runs them one after the other in the same ranks, each in its
    own run directory with its own counts; one start of the ranks instead of one per run.
    ``run_env``: one dict (or None) per run, that run's own environment variables.
    ``kw`` as for ``run_ranks`` (no rank reports)."""
    run_env = run_env or [None] * len(runs)
    assert len(run_env) == len(runs), (len(run_env), len(runs))
    args = []
    for argv, env in zip(runs, run_env):
        own = [t for k, v in (env or {}).items() for t in ("--env", f"{k}={v}")]
        args += [*(["--"] if args else []), *own, *map(str, argv)]
    return run_ranks(ROOT / "tests/ranks/sweep_rank.py", args=args, reports=False, **kw)


def rank_process(job: RankJob, rank: int, script: str = "train_rank.py"):
    """The psutil process of ``rank`` in ``job`` (its HOROVOD_RANK under horovodrun, its
    RANK under torchrun), or None."""
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            env = p.environ()
            if script in " ".join(p.cmdline()) and env.get("HOROVOD_RANK", env.get("RANK")) == str(rank):
                return p
        except psutil.Error:
            pass
    return None


def kill9_after_first_checkpoint(job: RankJob, run_dir: Path, *, world: int = 2, timeout: float = 180) -> int:
    """Wait until ``job`` has written its first complete checkpoint, then SIGKILL its whole
    tree; returns the newest complete step (the job may have gone further before the kill)."""
    from parle_hvd import checkpoint
    t0 = time.monotonic()
    while checkpoint.latest_complete(run_dir, world) is None:
        assert job.proc.poll() is None, job.output
        assert time.monotonic() - t0 < timeout, job.output
        time.sleep(0.02)
    job.kill()
    return checkpoint.latest_complete(run_dir, world)
