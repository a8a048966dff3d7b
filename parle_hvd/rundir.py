"""Starting a run: rank 0 resolves the run directory and any checkpoint a resume may
use and sends them with its config to every rank; then the ranks agree on the newest
checkpoint that loads everywhere. Failures are one-line ``RunError``s."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from . import checkpoint, comm
from .checkpoint import CheckpointError
from .config import Config, to_dict


class RunError(RuntimeError):
    """A problem with the run itself (directory, resume); one line, exit 2."""


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    try:
        import horovod
        v["horovod"] = horovod.__version__
    except ImportError:
        v["horovod"] = None
    from . import __version__
    v["parle_hvd"] = __version__
    return v


def resolve_run_dir(cfg: Config) -> tuple[Path, Optional[Path]]:
    """Rank 0 only: the run directory, created and checked writable, and the topmost
    directory this call created (None if the run directory existed): a start that fails
    removes that again if the run directory holds nothing (``discard_if_empty``)."""
    if cfg.run.dir:
        d = Path(cfg.run.dir)
    elif cfg.run.resume:
        cands = sorted(Path("runs").glob(f"{cfg.run.name}-*"), key=lambda p: p.stat().st_mtime)
        cands = [c for c in cands if checkpoint.steps(c)]
        if not cands:
            raise RunError(f"run.resume: no runs/{cfg.run.name}-* directory with a checkpoint; set run.dir")
        d = cands[-1]
    else:
        d = Path("runs") / f"{cfg.run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    created = None
    if not d.exists():
        created = d
        while not created.parent.exists():
            created = created.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunError(f"run.dir: cannot write to {d} ({e.strerror or e})") from None
    return d, created


def discard_if_empty(d: Path, created: Path) -> None:
    """What a start that failed leaves behind: remove ``created`` (the run directory ``d``
    or the topmost directory above it that the start made, e.g. ``runs/``) if ``d`` holds
    no file but the watchdog's heartbeats."""
    d = Path(d)
    try:
        if any(p.is_file() for p in d.rglob("*") if ".heartbeat" not in p.relative_to(d).parts):
            return
        shutil.rmtree(created, ignore_errors=True)
    except OSError:
        pass


def start_run(cfg: Config, rank: int) -> tuple[Config, Path, list, int, Optional[Path]]:
    """Rank 0 resolves the run directory and the checkpoint steps a resume may use (newest
    first, complete by their file names; ``agree_on_checkpoint`` then checks they load) and
    the number of ranks that wrote them, and sends them and its config to every rank (one
    source of truth even if the ranks' configs differ). An elastic run may resume a
    checkpoint written by another number of ranks; any other run needs its own number.
    Returns (config, run dir, steps, their world size, the directory rank 0 created or None)."""
    msg = None
    world = comm.size()
    created = None
    if rank == 0:
        d = None
        try:
            d, created = resolve_run_dir(cfg)
            cfg.run.dir = str(d)
            steps, ckpt_world = [], world
            if cfg.run.resume:
                if cfg.dist.elastic:
                    _, ckpt_world = checkpoint.latest_complete_any(d) or (None, world)
                steps = checkpoint.complete_steps(d, ckpt_world)
                if not steps:
                    raise RunError(f"run.resume: no complete checkpoint for {world} ranks in {d}/checkpoints"
                                   if not cfg.dist.elastic else f"run.resume: no complete checkpoint in {d}/checkpoints")
            msg = {"cfg": cfg, "steps": steps, "ckpt_world": ckpt_world}
        except RunError as e:
            if created:
                discard_if_empty(d, created)
            msg = {"error": str(e)}
    mine = to_dict(cfg)
    msg = comm.broadcast_object(msg)           # all ranks reach this
    if "error" in msg:
        raise RunError(msg["error"])
    theirs = to_dict(msg["cfg"])
    diff = sorted(f"{s}.{k}" for s in theirs if isinstance(theirs[s], dict)
                  for k in theirs[s] if mine[s][k] != theirs[s][k] and not (s == "run" and k in ("dir", "name")))
    if rank != 0 and diff:
        print(f"[rank {rank}] warning: config differs from rank 0's in {', '.join(diff)}; using rank 0's",
              file=sys.stderr, flush=True)
    return msg["cfg"], Path(msg["cfg"].run.dir), msg["steps"], msg["ckpt_world"], created


def agree_on_checkpoint(run_dir: Path, steps: list, rank: int, ckpt_world: int) -> tuple[Optional[int], dict, dict]:
    """Every rank tries to load its file of the complete ``steps`` (newest first); the ranks
    agree on the newest step that loads on every rank. Returns ``(step, this rank's state,
    {skipped step: this rank's error})``; step is None if no step loads everywhere.

    A round is one small allreduce of two flags per step (failed here, loaded here); each
    rank loads only what it must: its newest loadable file, then whatever step the round
    chose that it has not tried. Decisions follow the summed flags only, so every rank makes
    the same number of rounds. A rank without a replica in the checkpoint (an elastic run
    resumed on more ranks) loads nothing and agrees to every step. All ranks reach this."""
    tried: dict = {}

    def load(i: int) -> bool:
        if i not in tried:
            if rank >= ckpt_world:
                tried[i] = {}
            else:
                try:
                    tried[i] = checkpoint.load(run_dir, steps[i], rank)
                except CheckpointError as e:
                    tried[i] = e
        return not isinstance(tried[i], CheckpointError)

    world, i = comm.size(), 0
    while True:
        # my newest loadable step, at index i or later: the steps before it fail here
        j = i
        while j < len(steps) and not load(j):
            j += 1
        flags = torch.zeros(2, len(steps) + 1, dtype=torch.float64)
        for t, v in tried.items():
            flags[0 if isinstance(v, CheckpointError) else 1, t] = 1.0
        comm.allreduce_sum_([flags], name="resume.agree")        # all ranks reach this
        ok = [t for t in range(i, len(steps)) if flags[0, t] == 0]
        if not ok:
            errors = {steps[t]: str(v) for t, v in tried.items() if isinstance(v, CheckpointError)}
            return None, {}, errors
        t = ok[0]
        if flags[1, t] == world:                 # loaded on every rank
            errors = {steps[u]: str(v) for u, v in tried.items() if isinstance(v, CheckpointError) and u < t}
            return steps[t], tried[t], errors
        for u in list(tried):
            if u < t and not isinstance(tried[u], CheckpointError):
                tried.pop(u)                     # newer than any possible agreement: free its state
        load(t)                                  # the step every rank could still agree on: try it here
        i = t


def resume_point(run_dir: Path, steps: list, rank: int, ckpt_world: int) -> tuple[Optional[int], dict, list]:
    """``agree_on_checkpoint``, with its one-line reports: returns ``(step, this rank's
    state, newer steps skipped)``, ``(None, {}, [])`` without a checkpoint to resume, or
    raises when none loads on every rank. All ranks reach this."""
    if not steps:
        return None, {}, []
    step, st, skipped = agree_on_checkpoint(run_dir, steps, rank, ckpt_world)
    for s, why in skipped.items():
        print(f"[rank {rank}] run.resume: skipping checkpoint step {s}, which does not load here ({why})"
              + (f"; resuming from step {step}" if step is not None else ""), file=sys.stderr, flush=True)
    if step is None:
        if skipped:
            raise CheckpointError(f"run.resume: no checkpoint in {run_dir}/checkpoints loads on every "
                                  f"rank (this rank: {skipped[min(skipped)]})")
        raise RunError(f"run.resume: no checkpoint in {run_dir}/checkpoints loads on every rank "
                       f"(the failing ranks' messages above)")
    return step, st, [s for s in steps if s > step]
