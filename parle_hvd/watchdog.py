"""Stopping cleanly and failing loudly: signals, hung collectives, heartbeats.

* ``StopSignal``: SIGTERM or SIGINT (what SLURM sends before a preemption, or Ctrl-C) asks
  the run to stop; the trainer tells every rank in the next sync, all ranks stop after the
  same outer step, write a checkpoint and exit 0. A second SIGINT exits at once (130).
  One that comes while the rank is loading its data before the first sync (nothing
  trained, nothing to save) ends the process at once (``Interrupted``: exit 128 + the
  signal's number), not after the load and one outer step.
* ``Watchdog``: every collective is timed; one that waits longer than ``dist.timeout``
  seconds (a rank died or stopped answering; Gloo never gives up by itself) ends the
  process with one line naming the ranks whose heartbeat is behind, and exit code 4.
* Heartbeats: each rank rewrites ``<run.dir>/.heartbeat/rank-<r>`` as it enters each
  collective (how many it has entered, which, at which outer step). A rank that has entered
  fewer collectives than the waiting one is the silent one; the watchdog names it.
* Busy ranks: a rank doing long work between collectives (loading its data before the
  first sync) says so in ``busy(...)``: a thread rewrites its heartbeat every few seconds
  with a progress count (files listed, headers and examples read). A rank waiting for it
  goes on waiting while that count moves; only a busy rank whose count has not moved for
  ``dist.timeout`` seconds, or whose heartbeat stopped, is named. Both are judged by the
  waiting rank's own monotonic clock (when it saw the count, or the heartbeat, change), never
  by the time written in the file: the ranks' hosts need not agree on the time.
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


class Interrupted(BaseException):
    """A stop signal met during ``StopSignal.at_once(what)``. A BaseException, so that no
    ``except Exception`` on the way (a corrupt-file skip around a decode) swallows it."""

    def __init__(self, signum: int, what: str):
        super().__init__(f"{signal.Signals(signum).name} while {what}")
        self.signum, self.what = signum, what


class StopSignal:
    def __init__(self, rank: int):
        self.rank = rank
        self.requested: Optional[str] = None
        self._now: Optional[str] = None       # what the rank is doing where a stop ends it at once
        self._pid = os.getpid()
        self._prev: dict = {}                   # the handlers install() replaced

    @contextmanager
    def at_once(self, what: str):
        """Inside this block a SIGTERM or SIGINT raises ``Interrupted`` in the main thread
        rather than asking for a stop after the next outer step: for long work that leaves
        nothing to save (loading data before the first sync), so that a preempted job
        (scancel, a launcher ending the job because another rank failed) is not kept for
        the whole load, or killed after the launcher's grace period."""
        self._now = what
        try:
            yield
        finally:
            self._now = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid = os.getpid()
        for s in (signal.SIGTERM, signal.SIGINT):
            self._prev[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        """Give back the handlers ``install`` replaced (the run is over: whatever the script
        does next, a signal means what it meant before)."""
        if threading.current_thread() is threading.main_thread():
            for s, h in self._prev.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._prev = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if os.getpid() != self._pid:
            return                # a forked DataLoader worker: its process decides, and ends it
        if self._now is not None:
            what, self._now = self._now, None     # raised once: the unwinding is not interrupted again
            self.requested = name                 # a second SIGINT while unwinding exits at once
            raise Interrupted(signum, what)
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
        self._busy: Optional[str] = None
        self._alive = 0.0       # when a busy rank we wait for was last seen making progress
        self._progress: Callable[[], int] = lambda: 0
        self._moved: dict = {}  # rank -> (its last progress count seen, when it was first seen)
        self._beats: dict = {}  # rank -> (its last heartbeat line seen, when it was first seen)
        self._closed = threading.Event()
        if timeout > 0 and world > 1:
            threading.Thread(target=self._run, name="parle-watchdog", daemon=True).start()

    def close(self) -> None:
        """End the watching thread (the run is over)."""
        self._closed.set()

    def reset(self, rank: int, world: int) -> None:
        """A new world (elastic mode): new rank numbers, and every rank counts from zero."""
        self.rank, self.world, self._n = rank, world, 0
        self._moved.clear()     # the numbers now name other processes
        self._beats.clear()
        self._alive = 0.0

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
        what = f"busy:{self._busy}" if self._busy else (self._what[0] or "none")   # never empty: fields split on spaces
        try:
            tmp.write_text(f"{self._n} {self._what[1]} {what.replace(' ', '_')} {time.time():.3f} "
                           f"{int(self._progress())}\n")
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

    BUSY_EVERY = 2.0          # seconds between a busy rank's heartbeats

    @contextmanager
    def busy(self, what: str, progress: Callable[[], int]):
        """Long work outside any collective (``what``: "loading data"); ``progress()`` counts
        what is done. Heartbeats every BUSY_EVERY seconds until the block ends."""
        self._busy, self._progress = what, progress
        done = threading.Event()

        def beat():
            while not done.is_set():
                self._write()
                done.wait(self.BUSY_EVERY)
        t = threading.Thread(target=beat, name="parle-busy", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
            self._busy = None
            self._write()

    def _read(self, r: int) -> tuple:
        """(collectives entered, outer step, what, when this rank saw that heartbeat line
        first (its own monotonic clock), progress) of rank r."""
        try:
            line = (self.hb_dir / f"rank-{r}").read_text()
            f = line.split()
            n, step, what, prog = int(f[0]), int(f[1]), f[2].replace("_", " "), int(f[4]) if len(f) > 4 else 0
        except (OSError, ValueError, IndexError):
            return 0, -1, "none", 0.0, 0
        seen = self._beats.get(r)
        if seen is None or seen[0] != line:     # a new beat (every line carries its writer's time)
            self._beats[r] = seen = (line, time.monotonic())
        return n, step, what, seen[1], prog

    def behind(self) -> list:
        """(rank, outer step, collective) of every rank that has entered fewer collectives than
        this one and is not busy making progress (a rank loading its data is late, not lost)."""
        if not self.hb_dir:
            return []
        out, now = [], time.monotonic()
        for r in range(self.world):
            if r == self.rank:
                continue
            n, step, what, t, prog = self._read(r)
            if n >= self._n:
                continue
            if what.startswith("busy:"):
                last = self._moved.get(r)
                if last is None or last[0] != prog:
                    self._moved[r] = last = (prog, now)
                fresh = now - t < max(5 * self.BUSY_EVERY, self.timeout)
                if fresh and now - last[1] < self.timeout:
                    continue          # still at it: wait on
                what = (f"{what[5:]}, {prog} items, no progress for {now - last[1]:.0f} s" if fresh else
                        f"{what[5:]}, {prog} items, no heartbeat for {now - t:.0f} s")
            out.append((r, step, what))
        return out

    def waiting_on_busy(self) -> bool:
        """Whether every rank behind this one is busy and making progress."""
        if not self.hb_dir:
            return False
        return any(self._read(r)[2].startswith("busy:") for r in range(self.world) if r != self.rank) \
            and not self.behind()

    def _run(self) -> None:
        while not self._closed.wait(0.5):
            since = self._since
            now = time.monotonic()
            if since is None or now - since < self.timeout:
                continue
            if self.waiting_on_busy():
                # a rank still loading, and moving: not a hang; once it is done it has a
                # whole dist.timeout to reach this collective
                self._alive = now
                continue
            if now - self._alive < self.timeout:
                continue
            what, step = self._what
            late = self.behind()
            if late:
                who = "; ".join(f"rank {r} stopped answering (still {w})" if " items, no " in w else
                                f"rank {r} stopped answering (its last collective: {w} at outer step {s})"
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
