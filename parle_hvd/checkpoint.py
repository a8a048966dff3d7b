"""Checkpoints that survive a crash at any moment.

Layout: ``<run.dir>/checkpoints/step-<k>/rank-<r>.pt``, one file per replica, written by
that rank. Each file is written to a temporary name, fsynced, renamed, and its directory
fsynced, so a file with the final name is always complete. A checkpoint step is complete
when every rank's file exists. Older files are pruned only after a newer one is written,
keeping ``keep >= 2``: since ranks pass a sync between two checkpoints, the slowest rank
is at most one checkpoint behind, and the newest step that every rank has always survives.
No collective is needed to write or to find a checkpoint.
"""
from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

_STEP = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / "checkpoints" / f"step-{step:08d}"


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj, path: Path) -> None:
    """torch.save to ``path`` so that ``path`` is either absent, the old file, or complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if os.environ.get("PARLE_HVD_CKPT_DELAY"):
            # testing hook (tests/test_robustness.py): a slow disk, so a kill can land mid-write
            time.sleep(float(os.environ["PARLE_HVD_CKPT_DELAY"]))
        os.replace(tmp, path)
    except RuntimeError as e:
        # torch's zip writer reports a short write (full disk, file-size limit) this way
        tmp.unlink(missing_ok=True)
        raise OSError(errno.EIO, "write failed (disk full or file too large?)", str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(root: Path, step: int, rank: int, state: dict, keep: int) -> Path:
    path = step_dir(root, step) / f"rank-{rank}.pt"
    atomic_save(state, path)
    prune(root, rank, keep)
    return path


def steps(root: Path) -> list[int]:
    d = Path(root) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP.match(p.name)))


def prune(root: Path, rank: int, keep: int) -> None:
    """Remove this rank's files older than its ``keep`` newest; empty step dirs go too.
    Rank 0 also removes whole step dirs older than its ``keep`` newest: the files of ranks
    that no longer exist (an elastic run that shrank) would otherwise stay for ever, and no
    rank is more than one checkpoint behind rank 0."""
    mine = [s for s in steps(root) if (step_dir(root, s) / f"rank-{rank}.pt").exists()]
    for s in mine[:-keep]:
        d = step_dir(root, s)
        (d / f"rank-{rank}.pt").unlink(missing_ok=True)
        try:
            d.rmdir()      # only when no other rank's file is left
        except OSError:
            pass
    if rank == 0 and len(mine) >= keep:
        for s in steps(root):
            if s < mine[-keep]:
                shutil.rmtree(step_dir(root, s), ignore_errors=True)


def complete_steps(root: Path, world: int) -> list[int]:
    """The steps, newest first, for which every rank 0..world-1 has a file (and no rank
    beyond: an elastic run's step written by more ranks is not this world's). A file that
    exists may still be torn (a node lost mid-write on a shared filesystem): the resume
    checks that each loads (rundir.agree_on_checkpoint)."""
    out = []
    for s in reversed(steps(root)):
        d = step_dir(root, s)
        if all((d / f"rank-{r}.pt").is_file() for r in range(world)) and not (d / f"rank-{world}.pt").exists():
            out.append(s)
    return out


def latest_complete(root: Path, world: int) -> Optional[int]:
    """The newest complete step (``complete_steps``), or None."""
    c = complete_steps(root, world)
    return c[0] if c else None


def set_aside(root: Path, step: int) -> Path:
    """Move an unusable step (a file that does not load) out of the way, kept for a look:
    ``checkpoints/unreadable-step-<k>`` (no longer a step to resume or prune)."""
    src = step_dir(root, step)
    dst = src.with_name(f"unreadable-{src.name}")
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(src, dst)
    return dst


def _load(path: Path, **kw):
    """torch.load of one of our checkpoint files, weights only. A file written before they
    were weights-only (numpy's RNG state pickled) is refused by that unpickler for its
    numpy global alone: our own file, read the old way, so that an upgraded run resumes."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        if "numpy" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=False, **kw)


def latest_complete_any(root: Path) -> Optional[tuple[int, int]]:
    """(step, world) of the newest step that is complete for the world size that wrote it
    (read from its rank-0 file), or None. For resuming an elastic run with another size."""
    for s in reversed(steps(root)):
        d = step_dir(root, s)
        try:
            world = int(_load(d / "rank-0.pt", mmap=True)["world"])
        except Exception:  # noqa: BLE001 - missing or unreadable: not complete
            continue
        if latest_complete(root, world) == s:
            return s, world
    return None


def load(root: Path, step: int, rank: int) -> dict:
    path = step_dir(root, step) / f"rank-{rank}.pt"
    try:
        return _load(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear error
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.__class__.__name__}: {e})") from None


def discard_after(root: Path, step: int) -> None:
    """Remove step directories newer than ``step`` (incomplete leftovers of a crash)."""
    for s in steps(root):
        if s > step:
            shutil.rmtree(step_dir(root, s), ignore_errors=True)
