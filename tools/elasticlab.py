"""Several "hosts" for Horovod's elastic mode on this machine: one network namespace whose
loopback carries 127.0.0.1 ... 127.0.0.n. Horovod runs a rank locally (no ssh) when the
host's address is one of the machine's, and it blacklists a failed rank's *host*: with
each rank on its own address, killing one rank takes out one "host", as on a cluster.
Nothing inside can reach or be reached from outside the namespace.

    with LoopbackHosts(4) as lab:
        subprocess.run(lab.prefix + ["horovodrun", "--gloo", "-np", "3", "--min-np", "2", ...])
        lab.hosts        # ["127.0.0.1", "127.0.0.2", ...]

On exit every process left in the namespace is killed and the namespace deleted, also
when the body raises. Needs root and iproute2.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import List, Optional

from .lab import Lab


class ElasticLabError(RuntimeError):
    pass


def _run(*cmd, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ElasticLabError(f"{' '.join(map(str, cmd))}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> Optional[str]:
    """None if a lab can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip"):
        return "ip not found (apt-get install iproute2)"
    return None


class LoopbackHosts(Lab):
    def __init__(self, n: int = 4):
        why = available()
        if why:
            raise ElasticLabError(why)
        self.n = n
        self.ns = f"plabel{os.getpid() % 100000:05d}"
        self.hosts: List[str] = [f"127.0.0.{i + 1}" for i in range(n)]
        self._made = False

    @property
    def prefix(self) -> List[str]:
        """Prepend to a command to run it inside the lab."""
        return ["ip", "netns", "exec", self.ns]

    def _up(self) -> None:
        _run("ip", "netns", "add", self.ns)
        self._made = True
        _run(*self.prefix, "ip", "link", "set", "lo", "up")
        for h in self.hosts[1:]:
            _run(*self.prefix, "ip", "addr", "add", f"{h}/8", "dev", "lo")

    def pids(self) -> List[int]:
        return [int(p) for p in _run("ip", "netns", "pids", self.ns, check=False).stdout.split()]

    def close(self) -> None:
        if not self._made:
            return
        for p in self.pids():                     # anything a test left running inside
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _run("ip", "netns", "del", self.ns, check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.ns in _run("ip", "netns", "list").stdout.split():
            time.sleep(0.1)
        self._made = False
