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
from typing import List, Optional

from .lab import Lab, LabError, netns_pids, remove_netns, run


class ElasticLabError(LabError):
    pass


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
        run("ip", "netns", "add", self.ns, error=ElasticLabError)
        self._made = True
        run(*self.prefix, "ip", "link", "set", "lo", "up", error=ElasticLabError)
        for h in self.hosts[1:]:
            run(*self.prefix, "ip", "addr", "add", f"{h}/8", "dev", "lo", error=ElasticLabError)

    def pids(self) -> List[int]:
        return netns_pids(self.ns)

    def close(self) -> None:
        if self._made:
            remove_netns([self.ns])
            self._made = False
