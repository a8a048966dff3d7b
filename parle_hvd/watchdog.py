"""Stopping cleanly and failing loudly: signals, hung collectives, heartbeats.

* ``StopSignal``: SIGTERM or SIGINT (what SLURM sends before a preemption, or Ctrl-C) asks
  the run to stop; the trainer tells every rank in the next sync, all ranks stop after the
  same outer step, write a checkpoint and exit 0. A second SIGINT exits at once (130).
* ``Watchdog``: every collective is timed; one that waits longer than ``dist.timeout``
  seconds (a rank died or stopped answering; Gloo never gives up by itself) ends the
  process with one line naming the ranks whose heartbeat is behind, and exit code 4.
* Heartbeats: each rank rewrites ``<run.dir>/.heartbeat/rank-<r>`` as it enters each
  collective (how many it has entered, which, at which outer step). A rank that has entered
  fewer collectives than the waiting one is the silent one; the watchdog names it.
Nothing here imports Horovod.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional


class StopSignal:
    def __init__(self, rank: int):
        self.rank = rank
        self.requested: Optional[str] = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            os.write(2, f"[rank {self.rank}] second SIGINT: exiting now\n".encode())
            os._exit(130)
        if self.requested is None:
            os.write(2, f"[rank {self.rank}] {name}: stopping after this outer step, with a checkpoint "
                        f"(SIGINT again to exit at once)\n".encode())
        self.requested = name


class Watchdog:
    def __init__(self, timeout: float, rank: int, world: int, on_fail: Optional[Callable[[], None]] = None):
        self.timeout, self.rank, self.world = timeout, rank, world
        self.hb_dir: Optional[Path] = None
        self.on_fail = on_fail
        self._since: Optional[float] = None
        self._what = ("", 0)
        self._n = 0           # collectives entered
        if timeout > 0 and world > 1:
            threading.Thread(target=self._run, name="parle-watchdog", daemon=True).start()

    def reset(self, rank: int, world: int) -> None:
        """A new world (elastic mode): new rank numbers, and every rank counts from zero."""
        self.rank, self.world, self._n = rank, world, 0

    def attach(self, run_dir: Path) -> None:
        self.hb_dir = Path(run_dir) / ".heartbeat"
        try:
            self.hb_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.hb_dir = None

    def _write(self) -> None:
        if not self.hb_dir:
            return
        p = self.hb_dir / f"rank-{self.rank}"
        tmp = p.with_name(f".rank-{self.rank}.tmp")
        try:
            tmp.write_text(f"{self._n} {self._what[1]} {self._what[0].replace(' ', '_')} {time.time():.3f}\n")
            os.replace(tmp, p)
        except OSError:
            pass

    @contextmanager
    def collective(self, what: str, step: int):
        self._n += 1
        self._what = (what, step)
        self._write()
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def behind(self) -> list:
        """(rank, outer step, collective) of every rank that has entered fewer collectives than this one."""
        if not self.hb_dir:
            return []
        out = []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                n, step, what = (self.hb_dir / f"rank-{r}").read_text().split()[:3]
                n, step = int(n), int(step)
            except (OSError, ValueError):
                n, step, what = 0, -1, "none"
            if n < self._n:
                out.append((r, step, what.replace("_", " ")))
        return out

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            since = self._since
            if since is None or time.monotonic() - since < self.timeout:
                continue
            what, step = self._what
            late = self.behind()
            if late:
                who = "; ".join(f"rank {r} stopped answering (its last collective: {w} at outer step {s})"
                                if s >= 0 else f"rank {r} stopped answering (no heartbeat)" for r, s, w in late)
            else:
                who = "every rank reached it; the network or a rank's process is stuck"
            msg = (f"error: rank {self.rank} waited {self.timeout:.0f} s in the {what} collective at outer step "
                   f"{step}: {who}. Raise dist.timeout if the job is only slow.")
            try:
                if self.on_fail:
                    self.on_fail()
            finally:
                sys.stderr.write(msg + "\n")
                sys.stderr.flush()
                os._exit(4)
