"""What every lab shares: built on ``with``, torn down on exit, also when building fails;
running a command with a one-line error; tearing down network namespaces."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Iterable


class LabError(RuntimeError):
    pass


def run(*cmd, check: bool = True, error: type = LabError, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing its output; a failure (with ``check``) raises ``error`` with one line."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise error(f"{' '.join(map(str, cmd))}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def netns_pids(ns: str) -> list[int]:
    return [int(p) for p in run("ip", "netns", "pids", ns, check=False).stdout.split()]


def remove_netns(names: Iterable[str], timeout: float = 10.0) -> None:
    """Kill every process left in the namespaces, delete them, and wait until they are gone."""
    names = list(names)
    for ns in names:
        for p in netns_pids(ns):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in names:
        run("ip", "netns", "del", ns, check=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and set(names) & set(run("ip", "netns", "list").stdout.split()):
        time.sleep(0.1)


class Lab:
    def _up(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()          # a half-built lab is removed too
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
