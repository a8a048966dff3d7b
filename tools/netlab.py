"""Two (or more) real "hosts" on this machine, for tests and benchmarks that must cross a
network: each host is a network namespace with its own address on a bridge this module
creates, its own hostname and /etc/hosts (UTS and mount namespaces), and its own sshd
listening only on that address with a key made here. Each host's link can be rate-limited
with ``tc qdisc ... tbf``. Nothing listens or sends anywhere but the addresses made here.

    with TwoHosts(rate="10mbit") as lab:
        subprocess.run(lab.horovodrun(np_per_host=1) + [python, "train.py", ...])
        subprocess.run(lab.mpirun(np_per_host=1) + [python, "train.py", ...])

Everything (sshd, processes left in the namespaces, namespaces, veths, bridge, keys) is
removed on exit, also when the body raises. Needs root, iproute2, openssh-server.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from .lab import Lab, LabError, remove_netns, run


class NetLabError(LabError):
    pass


def _run(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    return run(*cmd, check=check, error=NetLabError, **kw)


def _links() -> set:
    return {l.split()[0].split("@")[0] for l in _run("ip", "-br", "link").stdout.splitlines() if l.strip()}


def _used_subnets() -> set:
    out = _run("ip", "-br", "-4", "addr").stdout
    return {a.split("/")[0].rsplit(".", 1)[0] for line in out.splitlines() for a in line.split()[2:]}


def available() -> Optional[str]:
    """None if a lab can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen", "/usr/sbin/sshd"):
        if not shutil.which(tool):
            return f"{tool} not found (apt-get install iproute2 openssh-server openssh-client util-linux)"
    return None


class TwoHosts(Lab):
    """``n`` hosts (default 2) named hostA, hostB, ... on a private /24."""

    def __init__(self, rate: Optional[str] = None, n: int = 2, burst: str = "64kb", latency: str = "200ms"):
        why = available()
        if why:
            raise NetLabError(why)
        self.n, self.rate, self.burst, self.latency = n, rate, burst, latency
        tag = f"{os.getpid() % 100000:05d}"
        self.iface = next(f"plab{i}" for i in range(100) if f"plab{i}" not in _links())   # bridge AND host NIC name
        used = _used_subnets()
        third = next(x for x in range(231, 255) if f"10.{x % 256}.{int(tag) % 200 + 20}" not in used)
        self.prefix = f"10.{third}.{int(tag) % 200 + 20}"
        self.names = [f"host{chr(ord('A') + i)}" for i in range(n)]
        self.netns = [f"plab{tag}{chr(ord('a') + i)}" for i in range(n)]
        self.addrs = [f"{self.prefix}.{i + 1}" for i in range(n)]
        self.launcher_addr = f"{self.prefix}.254"
        self.dir: Optional[Path] = None
        self._made = {"bridge": False, "netns": [], "veth": []}

    # ------------------------------------------------------------------ lifecycle
    def _up(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="parle_netlab_"))
        d = self.dir
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", d / "hostkey")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", d / "id")
        shutil.copy(d / "id.pub", d / "authorized_keys")
        os.chmod(d / "authorized_keys", 0o600)
        (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addrs, self.names)) + f"{self.launcher_addr} launcher\n")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)     # sshd's privilege-separation dir

        _run("ip", "link", "add", self.iface, "type", "bridge")
        self._made["bridge"] = True
        _run("ip", "addr", "add", f"{self.launcher_addr}/24", "dev", self.iface)
        _run("ip", "link", "set", self.iface, "up")
        for i, (ns, host, addr) in enumerate(zip(self.netns, self.names, self.addrs)):
            veth = f"{ns[-6:]}v{i}"
            _run("ip", "netns", "add", ns)
            self._made["netns"].append(ns)
            # the host's NIC has the bridge's name, so Horovod finds one interface common to all
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", self.iface, "netns", ns)
            self._made["veth"].append(veth)
            _run("ip", "link", "set", veth, "master", self.iface, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", self.iface)
            _run("ip", "-n", ns, "link", "set", self.iface, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            (d / f"sshd_{host}.conf").write_text(
                f"ListenAddress {addr}\nPort 22\nHostKey {d}/hostkey\nPermitRootLogin yes\n"
                f"PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                f"AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\n"
                f"PidFile {d}/sshd_{host}.pid\nMaxStartups 100\nMaxSessions 100\n"
                # root may run OpenMPI's orted here
                f"SetEnv OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1\n")
            # sshd (and all it starts) sees its own hostname and /etc/hosts
            _run("ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                 f"mount --bind {d}/hosts /etc/hosts && hostname {host} && "
                 f"exec /usr/sbin/sshd -f {d}/sshd_{host}.conf -E {d}/sshd_{host}.log")
        self.set_rate(self.rate)
        deadline = time.monotonic() + 20
        for addr in self.addrs:
            while _run(*self.ssh(addr), "true", check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise NetLabError(f"sshd on {addr} does not answer: {(d / 'sshd_hostA.log').read_text()[-500:]}")
                time.sleep(0.2)

    def close(self) -> None:
        d = self.dir
        for host in self.names:
            pidf = d / f"sshd_{host}.pid" if d else None
            if pidf and pidf.exists():
                try:
                    os.kill(int(pidf.read_text().strip()), signal.SIGKILL)
                except (ValueError, ProcessLookupError):
                    pass
        for veth in self._made["veth"]:
            _run("ip", "link", "del", veth, check=False)
        remove_netns(self._made["netns"])        # with anything a test left running on the hosts
        if self._made["bridge"]:
            _run("ip", "link", "del", self.iface, check=False)
        self._made = {"bridge": False, "netns": [], "veth": []}
        if d:
            shutil.rmtree(d, ignore_errors=True)
            self.dir = None

    # ------------------------------------------------------------------ the link
    def set_rate(self, rate: Optional[str]) -> None:
        """Throttle every host's egress (so both directions of every flow) to ``rate``
        (tc syntax, e.g. "10mbit"), or remove the throttle with None."""
        self.rate = rate
        for ns in self.netns:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", self.iface, "root", check=False)
            if rate:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.iface, "root", "tbf",
                     "rate", rate, "burst", self.burst, "latency", self.latency)

    def qdisc(self, i: int = 0) -> str:
        return _run("ip", "netns", "exec", self.netns[i], "tc", "qdisc", "show", "dev", self.iface).stdout

    # ------------------------------------------------------------------ launch lines
    def ssh_opts(self) -> List[str]:
        return ["-i", str(self.dir / "id"), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]

    def ssh(self, addr: str) -> List[str]:
        return ["ssh", *self.ssh_opts(), addr]

    def hosts_arg(self, np_per_host: int = 1) -> str:
        return ",".join(f"{a}:{np_per_host}" for a in self.addrs)

    def horovodrun_args(self) -> List[str]:
        """Extra horovodrun arguments: the lab's ssh key, and its interface for all traffic."""
        return ["--ssh-identity-file", str(self.dir / "id"), "--network-interface", self.iface]

    def mpirun_env(self) -> dict:
        """OpenMPI settings (as OMPI_MCA_* environment variables, which mpirun forwards to
        its daemons): ssh with the lab's key, TCP over the lab's interface only."""
        return {"OMPI_MCA_plm_rsh_agent": "ssh " + " ".join(self.ssh_opts()), "OMPI_MCA_btl": "tcp,self",
                "OMPI_MCA_btl_tcp_if_include": self.iface, "OMPI_MCA_oob_tcp_if_include": self.iface}

    def horovodrun(self, horovodrun: str, np_per_host: int = 1) -> List[str]:
        return [horovodrun, "--gloo", "-np", str(np_per_host * self.n), "-H", self.hosts_arg(np_per_host),
                *self.horovodrun_args()]

    def hostfile(self, np_per_host: int = 1) -> Path:
        """An OpenMPI hostfile naming every host with ``np_per_host`` slots."""
        f = self.dir / f"hostfile-{np_per_host}"
        f.write_text("".join(f"{a} slots={np_per_host}\n" for a in self.addrs))
        return f


def snapshot() -> dict:
    """What a lab must leave as it found: namespaces, links, and processes (sshd or
    anything else) started from a lab's directory."""
    import psutil
    procs = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and "parle_netlab_" in " ".join(p.info["cmdline"] or []):
                procs.append(" ".join(p.info["cmdline"]))
        except psutil.Error:
            pass
    return {"netns": sorted(_run("ip", "netns", "list").stdout.split()), "links": sorted(_links()),
            "processes": sorted(procs)}
