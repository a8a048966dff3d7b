"""The comm module: exact fused means, broadcasts and counters, under Gloo and MPI, and
at world size 1 without any launcher. Also the multi-rank harness's hang handling."""
import subprocess
import sys
import time

import psutil
import pytest

from multirank import ENGINE_OF, ROOT, MultiRankError, RankJob, horovod_installed, run_ranks

# Horovod's engine under horovodrun --gloo and mpirun; torch.distributed's under torchrun and mpirun
HVD = pytest.mark.horovod     # skipped where Horovod is not installed (conftest.py)
CONTROLLERS = [pytest.param("gloo", marks=HVD), pytest.param("mpi", marks=HVD), "torchrun", "mpi-torch"]


@HVD
def test_horovod_is_built_with_gloo_and_mpi():
    """Horovod's own probes (a forked child imports horovod.torch), asked here once: the
    harness's Gloo launches skip the probe horovodrun makes each time (tests/horovodrun_unprobed.py)."""
    from horovod.common.util import gloo_built, mpi_built
    assert gloo_built() and mpi_built()


@pytest.mark.multirank
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_collectives_exact(controller):
    res = run_ranks(ROOT / "tests/ranks/comm_check.py", controller=controller, np=2, timeout=120)
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["size"] == 2 and r["engine"] == ENGINE_OF[controller]
        assert r["controller"] == (controller if ENGINE_OF[controller] == "horovod" else "gloo")   # torch: its backend
        # every constant tensor (rank numbers 0 and 1) averages to exactly 0.5, shape and dtype kept
        for vals in r["mean_values"][:-1]:
            assert vals == [0.5] * len(vals)
        # (0..5)*1 and (0..5)*2 average to (0..5)*1.5
        assert r["mean_values"][-1] == [1.5 * i for i in range(6)]
        assert r["mean_dtypes"] == (["torch.float32"] * 4 + ["torch.float64"] * 4
                                    + ["torch.bfloat16"] * 4 + ["torch.float32"])
        assert r["mean_shapes"] == [[3], [2, 5], [4, 1, 3], []] * 3 + [[2, 3]]
        assert r["mean_calls"] == 1
        assert r["mean_bytes"] == r["mean_expected_bytes"]
        assert r["fused_mean"] == [0.5] * 5 and r["fused_sum"] == [1.0, 2.0]
        assert r["async_mean"] == [0.5] * 4 and r["async_sum"] == [3.0]
        # broadcast: rank 0's values, bit-exact, every dtype, one call
        assert r["bcast"] == [[[10.0, 10.0]] * 3, [0, 0], [0.1, 0.1]]
        assert r["bcast_calls"] == 1 and r["bcast_bytes"] == r["bcast_expected_bytes"]
        assert r["obj"] == {"from": 0, "cfg": {"lr": 0.1}}
        # exact totals: 3 allreduces (mean, fused, async) + 3 broadcasts (tensors, obj length, obj payload)
        s = r["stats"]
        assert s["allreduce_calls"] == 3 and s["broadcast_calls"] == 3
        assert s["allreduce_bytes"] == r["mean_expected_bytes"] + 4 * 7 + 8 * 5
        assert s["broadcast_bytes"] == r["bcast_expected_bytes"] + 8 + r["obj_pickle_bytes"]


def test_world_size_one_without_launcher():
    """No launcher: Horovod is not imported, collectives are identities, counters stay 0."""
    code = """
import sys, torch
from parle_hvd import comm
comm.init()
assert not comm.is_initialized() and comm.size() == 1 and comm.rank() == 0
t = torch.arange(5.0); comm.allreduce_mean_([t]); assert t.tolist() == [0, 1, 2, 3, 4]
comm.allreduce_sum_([t]); comm.broadcast_([t]); assert t.tolist() == [0, 1, 2, 3, 4]
assert comm.broadcast_object({'a': 1}) == {'a': 1}
assert comm.stats().calls == 0 and comm.stats().bytes == 0
assert 'horovod' not in sys.modules, 'horovod imported at world size 1'
comm.shutdown()
print('OK')
"""
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("HOROVOD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"


def _leftovers(marker: str, job=None):
    """Processes with ``marker`` in their command line (of ``job`` only: its PARLE_TEST_OUT)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in c for c in (p.info["cmdline"] or [])) and \
                    (job is None or p.environ().get("PARLE_TEST_OUT") == str(job.out)):
                found.append(p.info)
        except psutil.Error:
            pass
    return found


HANG_CONTROLLERS = ("gloo", "mpi", "torchrun") if horovod_installed() else ("torchrun",)   # mpi-torch's = torchrun's
HANG_GRACE = 2        # the harness's timeout: this long after both ranks are in place (the three
                      # jobs start together: in place after 5-9 s here, alone after 2-3 s)


@pytest.fixture(scope="module")
def hang_jobs():
    """The silent-rank jobs, started together: each waits out the harness's timeout with its
    ranks asleep, so they wait side by side rather than one after the other."""
    jobs = {c: RankJob([ROOT / "tests/ranks/die.py", "hang"], controller=c, np=2) for c in HANG_CONTROLLERS}
    yield jobs
    for j in jobs.values():
        j.kill()                                  # whatever is left of it (a failed test's job)


@pytest.mark.multirank
@pytest.mark.parametrize("controller,mode", [pytest.param(c, m, marks=[HVD] if c in ("gloo", "mpi") else [])
                                             for m in ("kill", "hang") for c in ("gloo", "mpi", "torchrun", "mpi-torch")
                                             if not (c == "mpi-torch" and m == "hang")])
def test_dead_or_silent_rank_fails_within_timeout_and_leaves_nothing(request, controller, mode):
    """Rank 1 dies with SIGKILL, or stops answering; rank 0 waits in an allreduce. The
    launcher may notice (horovodrun and mpirun abort the job when a rank dies); when it
    does not (a silent rank under Gloo hangs forever) the harness kills the whole tree at
    its timeout. Either way: an error with both ranks' output within the timeout, and no
    process left behind."""
    if mode == "kill":
        job, timeout = RankJob([ROOT / "tests/ranks/die.py", "kill"], controller=controller, np=2), 10
    else:
        job = request.getfixturevalue("hang_jobs")[controller]
        while not ("rank 1 about to hang" in job.output and "rank 0 entering allreduce" in job.output):
            assert job.proc.poll() is None and time.monotonic() - job.t0 < 120, job.output
            time.sleep(0.1)
        timeout = time.monotonic() - job.t0 + HANG_GRACE
    with pytest.raises(MultiRankError) as ei:
        rc = job.wait(timeout)                  # raises at the timeout, having killed the whole tree
        raise MultiRankError(f"{controller} job exited {rc}; output of every rank:\n{job.output}")
    assert ("timed out" in str(ei.value)) == (mode == "hang"), ei.value
    elapsed = time.monotonic() - job.t0
    msg = str(ei.value)
    assert elapsed < timeout + 15, elapsed
    assert f"rank 1 about to {'die' if mode == 'kill' else 'hang'}" in msg
    assert "rank 0 entering allreduce" in msg
    time.sleep(0.5)
    assert _leftovers("tests/ranks/die.py", job) == []      # this job's (the other hang jobs may still be waiting)


# ------------------------------------------------------------------------ engine selection
_LAUNCH_VARS = ("HOROVOD_RANK", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARLE_HVD_ENGINE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS",
                "SLURM_NNODES", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def bare_env(monkeypatch):
    for k in list(__import__("os").environ):
        if k in _LAUNCH_VARS or k.startswith(("OMPI_COMM_WORLD", "SLURM_", "MV2_", "PMI_", "PMIX_", "HOROVOD_")):
            monkeypatch.delenv(k)
    return monkeypatch


def test_engine_follows_the_launcher_and_refuses_what_cannot_work(bare_env):
    from parle_hvd import comm
    from multirank import horovod_installed
    bare_env.setenv("TORCHELASTIC_RUN_ID", "x")
    for k, v in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1").items():
        bare_env.setenv(k, v)
    assert comm.launched() and comm.resolve_engine("auto") == "torch" == comm.resolve_engine("torch")
    with pytest.raises(comm.EngineError, match="started by torchrun, which Horovod cannot join"):
        comm.resolve_engine("horovod")
    for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        bare_env.delenv(k)
    bare_env.setenv("HOROVOD_RANK", "0")
    assert comm.resolve_engine("auto") == "horovod"
    with pytest.raises(comm.EngineError, match="started by horovodrun"):
        comm.resolve_engine("torch")
    bare_env.delenv("HOROVOD_RANK")
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "2")            # mpirun: Horovod where it imports
    assert comm.resolve_engine("auto") == ("horovod" if horovod_installed() else "torch")
    bare_env.setenv("PARLE_HVD_ENGINE", "torch")            # the environment decides first
    assert comm.resolve_engine("auto") == "torch"
    bare_env.setenv("PARLE_HVD_ENGINE", "nccl")
    with pytest.raises(comm.EngineError, match="PARLE_HVD_ENGINE must be one of"):
        comm.resolve_engine("auto")


def test_a_script_imported_again_by_a_worker_does_not_join_the_world(monkeypatch):
    """forkserver and spawn workers (data.worker_start=auto in a multi-rank job) import the main
    script again; one without a __main__ guard would reach init, and MPI_Init in a worker
    aborts the job with MPI's own lines. It is one line saying what to do instead."""
    import multiprocessing
    from parle_hvd import comm
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(comm.EngineError, match=r'if __name__ == "__main__":.*data.worker_start=fork'):
        comm.init("auto")


def test_torch_engine_port_in_use_is_one_line(bare_env):
    """A port another process holds (a stale job, another user's) ends in one line that names
    it and the fix, not torch's DistNetworkError traceback; no silent retry on another port,
    which the other ranks could not know."""
    import socket
    import torch.distributed as dist
    from parle_hvd.torchdist import TorchEngine, WorldError
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
            bare_env.setenv(k, v)
        with pytest.raises(WorldError, match=rf"port {port} on 127.0.0.1 \(MASTER_PORT\) is already in use.*"
                                             r"export MASTER_PORT=<a free port> on every rank"):
            TorchEngine(timeout=5)
    assert not dist.is_initialized()


def test_torch_world_from_openmpi_slurm_and_pmi_variables(bare_env):
    from parle_hvd.torchdist import WorldError, world_from_env
    for k, v in dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
                     OMPI_COMM_WORLD_LOCAL_SIZE="2").items():
        bare_env.setenv(k, v)
    with pytest.raises(WorldError, match="export MASTER_ADDR"):       # two hosts: rank 0's host is unknown
        world_from_env()
    bare_env.setenv("MASTER_ADDR", "node1")
    w = world_from_env()
    assert (w["rank"], w["size"], w["local_rank"], w["local_size"], w["addr"]) == (3, 4, 1, 2, "node1")
    assert 20000 <= int(w["port"]) < 40000
    for k in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR"):
        bare_env.delenv(k)
    for k, v in dict(SLURM_PROCID="1", SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_LOCALID="1",
                     SLURM_JOB_ID="77").items():
        bare_env.setenv(k, v)
    w = world_from_env()
    assert (w["rank"], w["size"], w["local_rank"], w["local_size"], w["addr"]) == (1, 2, 1, 2, "127.0.0.1")
    bare_env.setenv("SLURM_JOB_ID", "78")                    # another job on the host: another port
    assert world_from_env()["port"] != w["port"]
    for k in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_LOCALID", "SLURM_JOB_ID"):
        bare_env.delenv(k)
    for k, v in dict(PMI_RANK="0", PMI_SIZE="2", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2").items():
        bare_env.setenv(k, v)
    w = world_from_env()
    assert (w["rank"], w["size"], w["addr"]) == (0, 2, "127.0.0.1")


def test_one_module_per_engine():
    """horovod.torch is imported by comm.py alone, torch.distributed is called by torchdist.py
    alone (DistributedDataParallel included), and nothing else in the package imports either."""
    import re
    hvd, tdist = {}, {}
    for f in sorted((ROOT / "parle_hvd").glob("*.py")):
        src = f.read_text()
        if re.search(r"^\s*(import horovod\.torch|from horovod\.torch|import horovod\.common|from horovod)", src, re.M):
            hvd[f.name] = True
        if re.search(r"^\s*(import|from) torch\.(distributed|nn\.parallel)|torch\.distributed\.\w+\(|"
                     r"DistributedDataParallel\(", src, re.M):
            tdist[f.name] = True
    assert list(hvd) == ["comm.py"], hvd
    assert list(tdist) == ["torchdist.py"], tdist


# ------------------------------------------------------------------------ the launcher's world, checked
def test_srun_without_pmi_chooses_torch_and_every_launcher_states_its_world(bare_env):
    """srun --mpi=none: Horovod's MPI would make each task rank 0 of a world of 1, so auto
    takes torch.distributed, which reads SLURM's variables. Every launcher's count is read."""
    from parle_hvd import comm
    for k, v in dict(SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_NNODES="1").items():
        bare_env.setenv(k, v)
    assert comm.launched() and comm.resolve_engine("auto") == "torch"
    with pytest.raises(comm.EngineError, match=r"srun started 2 tasks without PMI \(--mpi=none\)"):
        comm.resolve_engine("horovod")
    assert comm.stated_world() == ("SLURM (srun)", 2, 1)
    bare_env.setenv("SLURM_STEP_NUM_TASKS", "3")          # the step's count, not the job's
    assert comm.stated_world() == ("SLURM (srun)", 3, 1)
    bare_env.setenv("PMIX_RANK", "1")                     # srun --mpi=pmix: MPI sees the step
    assert comm.resolve_engine("auto") == ("horovod" if horovod_installed() else "torch")
    for k in ("SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_NNODES", "SLURM_STEP_NUM_TASKS"):
        bare_env.delenv(k)
    assert comm.launched() and comm.stated_world() == ("PMIx", None, 1)   # a rank, no count
    bare_env.delenv("PMIX_RANK")
    for k, v in dict(MV2_COMM_WORLD_RANK="1", MV2_COMM_WORLD_SIZE="4").items():
        bare_env.setenv(k, v)
    assert comm.stated_world() == ("MVAPICH", 4, 1)
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    bare_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert comm.stated_world() == ("OpenMPI (mpirun)", 2, 0)
    bare_env.setenv("HOROVOD_RANK", "1")
    bare_env.setenv("HOROVOD_SIZE", "2")
    assert comm.stated_world() == ("horovodrun", 2, 1)
    bare_env.setenv("HOROVOD_ELASTIC", "1")               # the world changes: nothing to hold it to
    assert comm.stated_world() is None


def _two_tasks(tmp_path, mode, overrides, timeout=120):
    """Two processes of train.py with a launcher's variables but no launcher (srun
    --mpi=none's SLURM variables, or MVAPICH's, or PMIx's rank alone)."""
    import os
    run = tmp_path / f"run-{mode}"
    procs = []
    for r in (0, 1):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_", "SLURM_", "MV2_", "PMI_", "PMIX_", "HOROVOD_", "PARLE_HVD_ENGINE"))}
        env.update({"slurm": dict(SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                                  SLURM_NNODES="1", SLURM_JOB_ID=f"{os.getpid()}"),
                    "mv2": dict(MV2_COMM_WORLD_RANK=str(r), MV2_COMM_WORLD_SIZE="2", MV2_COMM_WORLD_LOCAL_RANK=str(r),
                                MV2_COMM_WORLD_LOCAL_SIZE="2", MPIRUN_ID=f"{os.getpid()}"),
                    "pmix": dict(PMIX_RANK=str(r))}[mode])
        procs.append(subprocess.Popen(
            [sys.executable, "train.py", "--config", "configs/fashion_parle.yaml", "data.train_limit=1280",
             "data.test_limit=200", "train.epochs=1", "parle.sync_period=5", "train.batch_size=64",
             "eval.bn_batches=1", "run.progress=lines", "dist.threads=1", f"run.dir={run}", *overrides],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append((p.wait(timeout=timeout), p.stdout.read()))
        finally:
            p.kill()
    return run, outs


@pytest.mark.parametrize("mode,overrides,needle", [
    pytest.param("slurm", ["dist.engine=horovod"], "dist.engine=horovod: srun started 2 tasks without PMI "
                 "(--mpi=none), so MPI cannot see the step", marks=HVD),
    pytest.param("mv2", [], "MVAPICH started 2 tasks (this one rank 0), but the horovod engine made it rank 0 of a "
                 "world of 1", marks=HVD),
    ("pmix", ["dist.engine=torch"], "launched through PMIx (PMIX_RANK) without a task count"),
])
def test_a_launched_task_never_trains_alone(tmp_path, mode, overrides, needle):
    """srun without PMI under Horovod, MVAPICH's launcher (Horovod here is OpenMPI's), PMIx
    without a count: each ends with one line naming the launcher and the fix, exit 2, before
    any file is written (today's failure: n singletons writing one run directory)."""
    run, outs = _two_tasks(tmp_path, mode, overrides)
    for rc, out in outs:
        assert rc == 2, out
    lines = [l for _, out in outs for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines   # rank 0's, once
    assert "srun --mpi=pmix" in lines[0] or "dist.engine=torch" in lines[0] or "torchrun" in lines[0]
    assert not run.exists()


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["slurm", "mv2"])
def test_torch_engine_forms_the_launchers_world(tmp_path, mode):
    """The same two processes train as one world of 2 through torch.distributed: chosen by
    auto under srun without PMI (and said so), asked for under MVAPICH."""
    import json
    run, outs = _two_tasks(tmp_path, mode, ["dist.engine=torch"] if mode == "mv2" else [], timeout=180)
    assert [rc for rc, _ in outs] == [0, 0], outs
    s = json.loads((run / "summary.json").read_text())
    assert (s["world_size"], s["engine"]) == (2, "torch")
    assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    if mode == "slurm":
        assert "srun gave its 2 tasks no MPI world (--mpi=none): dist.engine=torch chosen" in outs[0][1]


def test_slurm_world_is_the_steps_layout(bare_env, tmp_path):
    """A step on part of the allocation (n3-n4 of n[1-4]) meets at its own first node, not
    the job's; an uneven layout (3 tasks on 2 nodes, 2(x1),1) gives the lone rank local_size
    1. scontrol is a fake here that knows four nodes and their addresses."""
    from parle_hvd import slurm
    from parle_hvd.torchdist import world_from_env
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/bash\n"
                    "if [[ \"$1 $2\" == 'show hostnames' ]]; then case $3 in 'n[1-4]') echo n1 n2 n3 n4;; 'n[3-4]') echo n3 n4;;"
                    " *) exit 1;; esac; fi\n"
                    "if [[ \"$1 $2\" == 'show node' ]]; then echo \"NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.${3#n} NodeHostName=$3\"; fi\n")
    fake.chmod(0o755)
    bare_env.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    # world_from_env exports the MASTER_ADDR it found: registered here so that the test's end removes it
    bare_env.setenv("MASTER_ADDR", "unset")
    bare_env.delenv("MASTER_ADDR")
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("4") == [4]
    with pytest.raises(slurm.SlurmError, match="tasks per node"):
        slurm.expand_tasks_per_node("2(x)")
    for k, v in dict(SLURM_JOB_ID="9", SLURM_STEP_ID="1", SLURM_JOB_NODELIST="n[1-4]", SLURM_NNODES="4",
                     SLURM_NTASKS="8", SLURM_TASKS_PER_NODE="2(x4)",
                     SLURM_STEP_NODELIST="n[3-4]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="3",
                     SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_NODEID="1", SLURM_PROCID="2", SLURM_LOCALID="0").items():
        bare_env.setenv(k, v)
    w = world_from_env()
    assert (w["rank"], w["size"], w["local_rank"], w["local_size"], w["addr"]) == (2, 3, 0, 1, "10.0.0.3")
    __import__("os").environ.pop("MASTER_ADDR")
    bare_env.setenv("SLURM_NODEID", "0")
    bare_env.setenv("SLURM_PROCID", "1")
    bare_env.setenv("SLURM_LOCALID", "1")
    w = world_from_env()
    assert (w["rank"], w["size"], w["local_rank"], w["local_size"], w["addr"]) == (1, 3, 1, 2, "10.0.0.3")


def test_slurm_sbatch_torchrun_starts_each_nodes_own_task_count(tmp_path):
    """LAUNCHER=torchrun on an uneven layout (3 tasks on 2 nodes: 2,1): one torchrun per
    node with that node's count, all meeting at the first node's NodeAddr. srun, scontrol and
    torchrun are fakes that print what they were asked to do."""
    import os
    from multirank import VENV_BIN, run_command
    (tmp_path / "srun").write_text("#!/bin/bash\n"      # one copy of the command per node, as srun would
                                   "while [[ $1 == --* ]]; do shift; done\n"
                                   "for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i \"$@\"; done\n")
    (tmp_path / "scontrol").write_text("#!/bin/bash\n[[ $2 == hostnames ]] && echo n1 n2 && exit 0\n"
                                       "echo \"NodeName=$3 NodeAddr=10.9.0.${3#n}\"\n")
    (tmp_path / "torchrun").write_text("#!/bin/bash\necho \"torchrun $*\"\n")
    for f in ("srun", "scontrol", "torchrun"):
        (tmp_path / f).chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "torchrun").symlink_to(tmp_path / "torchrun")
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "LAUNCHER": "torchrun", "VENV": os.path.relpath(venv, ROOT),
           "SHARED": str(tmp_path / "shared"), "SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NTASKS": "3",
           "SLURM_TASKS_PER_NODE": "2,1", "SLURM_JOB_NODELIST": "n[1-2]", "PYTHONPATH": str(ROOT)}
    rc, out = run_command(["bash", "launch/slurm.sbatch", "train.epochs=1"], env=env, timeout=60)
    assert rc == 0, out
    runs = [l for l in out.splitlines() if l.startswith("torchrun ")]
    assert len(runs) == 2, out
    for line, n in zip(runs, (2, 1)):
        assert line.startswith(f"torchrun --nproc-per-node {n} --nnodes 2 --rdzv-backend c10d "
                               f"--rdzv-endpoint 10.9.0.1:29400 --rdzv-id 42 --no-python "), line
        assert "train.py --config configs/fashion_parle.yaml" in line and line.endswith("train.epochs=1"), line
    rc, out = run_command(["bash", "launch/slurm.sbatch"], env={**env, "SLURM_TASKS_PER_NODE": "3"}, timeout=60)
    assert rc == 2 and "SLURM_TASKS_PER_NODE=3 names 3 for 2 node(s)" in out, out
