"""Launching where our users run, on real components: a one-node SLURM cluster started
here (sbatch launch/slurm.sbatch, with srun and with LAUNCHER=torchrun, then a requeue that
resumes from the checkpoint), and
two "hosts" in network namespaces with their own sshd, reached by horovodrun -H and by
mpirun with a hostfile, over a link throttled with tc tbf. Each test removes everything it
made (daemons, namespaces, interfaces, keys), also when it fails."""
import json
import math
import time
from pathlib import Path

import pytest

from multirank import ROOT, horovod_installed, run_command
from tools import netlab, slurmlab

HOROVOD = horovod_installed()

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]
SMALL = ["data.train_limit=2560", "data.test_limit=1000", "train.batch_size=64", "parle.sync_period=5",
         "eval.every=0.5", "eval.bn_batches=2", "run.progress=lines"]


def _summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def _need(why):
    if why:
        pytest.fail(f"cluster test cannot run: {why} (make setup installs what it needs)")


# ------------------------------------------------------------------------------ SLURM
def test_slurm_sbatch_trains_and_requeue_resumes(tmp_path):
    _need(slurmlab.available())
    before = slurmlab.snapshot()
    shared = tmp_path / "shared"
    try:
        with slurmlab.SlurmCluster() as slurm:
            # 1. a job runs to completion and leaves its summary on the shared path
            job = slurm.sbatch(["--ntasks=2", "-o", f"{tmp_path}/slurm-%j.out", "launch/slurm.sbatch",
                                *SMALL, "train.epochs=1"], env={"SHARED": str(shared)}, cwd=ROOT)
            state = slurm.wait(job, timeout=300)
            out = (tmp_path / f"slurm-{job}.out").read_text()
            assert state == "COMPLETED", out
            s = _summary(shared / f"parle-{job}")
            # srun: Horovod's MPI controller, or torch.distributed's Gloo where Horovod is not installed
            assert s["world_size"] == 2 and s["algo"] == "parle"
            assert (s["engine"], s["controller"]) == (("horovod", "mpi") if HOROVOD else ("torch", "gloo"))
            assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
            assert (shared / f"parle-{job}" / "tb").is_dir()

            # 1b. the same job with LAUNCHER=torchrun: one torchrun per node, torch.distributed
            job = slurm.sbatch(["--ntasks=2", "-o", f"{tmp_path}/slurm-%j.out", "launch/slurm.sbatch",
                                *SMALL, "train.epochs=1"], env={"SHARED": str(shared), "LAUNCHER": "torchrun"}, cwd=ROOT)
            state = slurm.wait(job, timeout=300)
            out = (tmp_path / f"slurm-{job}.out").read_text()
            assert state == "COMPLETED", out + slurm.logs()
            s = _summary(shared / f"parle-{job}")
            assert s["world_size"] == 2 and (s["engine"], s["controller"]) == ("torch", "gloo")
            assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]

            # 1c. srun --mpi=none (no PMI): Horovod's MPI would give each task a world of 1.
            #     auto takes torch.distributed from SLURM's variables and says so; Horovod asked
            #     for ends every task with one line and exit 2, nothing written
            py = ROOT / ".venv/bin/python" if (ROOT / ".venv/bin/python").exists() else Path(__import__("sys").executable)
            for engine in (["auto", "horovod"] if HOROVOD else ["auto"]):
                run = shared / f"mpi-none-{engine}"
                line = (f"{py} train.py --config configs/fashion_parle.yaml {' '.join(SMALL)} train.epochs=0.5 "
                        f"dist.threads=1 dist.engine={engine} run.dir={run}")
                job = slurm.sbatch(["--ntasks=2", "-o", f"{tmp_path}/slurm-%j.out", "--wrap",
                                    f"srun --mpi=none --kill-on-bad-exit=1 {line}"], cwd=ROOT)
                state = slurm.wait(job, timeout=300)
                out = (tmp_path / f"slurm-{job}.out").read_text()
                if engine == "auto":
                    assert state == "COMPLETED", out + slurm.logs()
                    assert "srun gave its 2 tasks no MPI world (--mpi=none): dist.engine=torch chosen" in out, out
                    s = _summary(run)
                    assert (s["world_size"], s["engine"]) == (2, "torch")
                    assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
                else:
                    assert state == "FAILED", out
                    assert ("error: dist.engine=horovod: srun started 2 tasks without PMI (--mpi=none), so MPI cannot "
                            "see the step") in out and "srun --mpi=pmix" in out, out
                    assert not run.exists()

            # 2. preemption: requeue a running job after its first checkpoint; the same job id
            #    comes back, finds the checkpoint and resumes from it
            job = slurm.sbatch(["--ntasks=2", "-o", f"{tmp_path}/slurm-%j.out", "launch/slurm.sbatch",
                                *SMALL, "train.epochs=6", "run.ckpt_every=2"], env={"SHARED": str(shared)}, cwd=ROOT)
            run = shared / f"parle-{job}"
            t0 = time.monotonic()
            from parle_hvd import checkpoint
            while checkpoint.latest_complete(run, 2) is None:
                assert time.monotonic() - t0 < 200 and slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING")
                time.sleep(0.1)
            slurm.requeue(job)
            state = slurm.wait(job, timeout=400)
            out = (tmp_path / f"slurm-{job}.out").read_text()
            assert state == "COMPLETED", out + slurm.logs()
            assert "restart 1" in out and "run.resume=true" in out, out
            s = _summary(run)
            assert s["resumed_from"] is not None and s["resumed_from"] >= 2, s["resumed_from"]
            assert s["outer_steps"] == math.ceil(6 * (2560 // 64) / 5)
    finally:
        assert slurmlab.snapshot() == before, "SLURM daemons or job steps left behind"


# ------------------------------------------------------------------------------ two hosts
def _launch_env(lab):
    return {"NP": "2", "HOSTS": lab.hosts_arg(1), "HOROVODRUN_ARGS": " ".join(lab.horovodrun_args()),
            "HOSTFILE": str(lab.hostfile(1)), **lab.mpirun_env()}


# The two "hosts" share this machine's cores: one torch thread per rank, not cores / local ranks.
HOSTS_SMALL = SMALL + ["dist.threads=1"]


@pytest.mark.horovod
def test_two_hosts_horovodrun_and_mpirun_over_throttled_link(tmp_path):
    _need(netlab.available())
    before = netlab.snapshot()
    try:
        with netlab.TwoHosts() as lab:
            env = _launch_env(lab)
            # horovodrun -H hostA:1,hostB:1 (by address), Gloo across the two namespaces
            rc, out = run_command(["launch/local.sh", *HOSTS_SMALL, "train.epochs=1", f"run.dir={tmp_path / 'hvd'}"],
                                  env=env, timeout=300)
            assert rc == 0, out
            s = _summary(tmp_path / "hvd")
            assert s["world_size"] == 2 and s["controller"] == "gloo"
            # mpirun with a hostfile naming the two hosts
            rc, out = run_command(["launch/mpirun.sh", *HOSTS_SMALL, "train.epochs=1", f"run.dir={tmp_path / 'mpi'}"],
                                  env=env, timeout=300)
            assert rc == 0, out
            s = _summary(tmp_path / "mpi")
            assert s["world_size"] == 2 and s["controller"] == "mpi"
            assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]

            # the throttle is real: data-parallel SGD (an allreduce every step) slows down at 10 Mbit
            per_step = {}
            for rate in (None, "10mbit"):
                lab.set_rate(rate)
                d = tmp_path / f"dpsgd-{rate}"
                rc, out = run_command(["launch/local.sh", *HOSTS_SMALL, "algo=dpsgd", "train.block=10", "train.epochs=1",
                                       "eval.every=100", f"run.dir={d}"], env=env, timeout=300)
                assert rc == 0, out
                s = _summary(d)
                per_step[rate or "unthrottled"] = s["wall_seconds"] / s["inner_steps"]
            assert "rate 10Mbit" in lab.qdisc(0)
            print(f"\ndpsgd wall seconds per step across two hosts: unthrottled {per_step['unthrottled']:.4f}, "
                  f"10 Mbit {per_step['10mbit']:.4f} ({per_step['10mbit'] / per_step['unthrottled']:.1f}x)")
            assert per_step["10mbit"] > per_step["unthrottled"]
    finally:
        assert netlab.snapshot() == before, "namespaces, interfaces or processes left behind"
