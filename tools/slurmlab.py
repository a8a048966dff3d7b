"""A real one-node SLURM cluster on this machine, for tests: slurmctld and slurmd started
from Debian's slurm-wlm with a config written here (auth/none, no munge, no cgroups, no
accounting), private ports and directories. Everything is stopped and removed on exit,
also when the body raises.

    with SlurmCluster() as slurm:
        job = slurm.sbatch(["launch/slurm.sbatch", "train.epochs=1"], env={...}, cwd=repo)
        state = slurm.wait(job, timeout=300)
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from .lab import Lab

PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib/slurm-wlm",
               "/usr/lib64/slurm")


class SlurmLabError(RuntimeError):
    pass


def available() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo"):
        if not shutil.which(tool):
            return f"{tool} not found (apt-get install slurm-wlm)"
    if not any(Path(d, "auth_none.so").exists() for d in PLUGIN_DIRS):
        return "slurm's auth_none plugin not found"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster(Lab):
    def __init__(self, cpus: Optional[int] = None, node: str = "parlenode"):
        why = available()
        if why:
            raise SlurmLabError(why)
        self.cpus = cpus or os.cpu_count() or 1
        self.node = node
        self.dir: Optional[Path] = None
        self.procs: list = []

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    def _up(self) -> None:
        d = self.dir = Path(tempfile.mkdtemp(prefix="parle_slurmlab_"))
        (d / "state").mkdir()
        (d / "spool").mkdir()
        plugins = next(p for p in PLUGIN_DIRS if Path(p, "auth_none.so").exists())
        mem = 1024
        (d / "slurm.conf").write_text(f"""ClusterName=parlelab
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
# job credentials live 5 s (default 120): also how long a requeued job waits before it restarts
AuthInfo=cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
PluginDir={plugins}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
# the main scheduling pass every 2 s (default 60): a requeued job is eligible again only
# after its credential expires, and no event wakes the scheduler then, so with the default
# it waited for the next pass (52 s seen here)
SchedulerParameters=sched_interval=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MinJobAge=3600
NodeName={self.node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem} State=UNKNOWN
PartitionName=lab Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        conf = str(d / "slurm.conf")
        for cmd in (["slurmctld", "-D", "-f", conf], ["slurmd", "-D", "-f", conf, "-N", self.node]):
            log = open(d / f"{cmd[0]}.out", "wb")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                               start_new_session=True))
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while True:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env)
            if r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise SlurmLabError(f"slurm did not come up ({r.stdout.strip()} {r.stderr.strip()}): "
                                    + (d / "slurmctld.out").read_text()[-400:] + (d / "slurmd.out").read_text()[-400:])
            time.sleep(0.3)

    def sbatch(self, args, *, env: Optional[dict] = None, cwd=None) -> int:
        r = subprocess.run(["sbatch", "--parsable", *map(str, args)], capture_output=True, text=True,
                           env={**self.env, **(env or {})}, cwd=cwd)
        if r.returncode != 0:
            raise SlurmLabError(f"sbatch failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job_state(self, job: int) -> str:
        r = subprocess.run(["scontrol", "show", "job", str(job)], capture_output=True, text=True, env=self.env)
        for tok in r.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job: int, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.job_state(job)
            if st in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE"):
                return st
            time.sleep(0.5)
        subprocess.run(["scancel", str(job)], env=self.env, capture_output=True)
        raise SlurmLabError(f"job {job} still {self.job_state(job)} after {timeout:.0f}s (cancelled)")

    def requeue(self, job: int) -> None:
        """Requeue a running job, as a preemption does; it restarts (same job id) once its
        old credential has expired (AuthInfo=cred_expire, 5 s here)."""
        r = subprocess.run(["scontrol", "requeue", str(job)], env=self.env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SlurmLabError(f"scontrol requeue {job}: {r.stderr.strip()}")

    def logs(self) -> str:
        return "".join((self.dir / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                       if self.dir and (self.dir / f).exists())

    def close(self) -> None:
        if self.dir:
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        # job steps the daemons started (slurmstepd and its children) are theirs to stop;
        # make sure none survives
        for pat in (f"slurmstepd.*{self.dir}",) if self.dir else ():
            subprocess.run(["pkill", "-9", "-f", pat], capture_output=True)
        self.procs = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def snapshot() -> list:
    """slurm daemons and job steps running now (a lab must leave none). Zombies, which
    hold nothing but a pid until init reaps them, are not counted."""
    import psutil
    found = []
    for p in psutil.process_iter(["pid", "name", "status", "cmdline"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(n in (p.info["name"] or "") for n in ("slurmctld", "slurmd", "slurmstepd")):
                found.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])}")
        except psutil.Error:
            pass
    return sorted(found)
