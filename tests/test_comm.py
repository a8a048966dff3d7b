"""The comm module: exact fused means, broadcasts and counters, under Gloo and MPI, and
at world size 1 without any launcher. Also the multi-rank harness's hang handling."""
import subprocess
import sys
import time

import psutil
import pytest

from multirank import ENGINE_OF, ROOT, MultiRankError, run_ranks

# Horovod's engine under horovodrun --gloo and mpirun; torch.distributed's under torchrun and mpirun
HVD = pytest.mark.horovod     # skipped where Horovod is not installed (conftest.py)
CONTROLLERS = [pytest.param("gloo", marks=HVD), pytest.param("mpi", marks=HVD), "torchrun", "mpi-torch"]


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


def _leftovers(marker: str):
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in c for c in (p.info["cmdline"] or [])):
                found.append(p.info)
        except psutil.Error:
            pass
    return found


@pytest.mark.multirank
@pytest.mark.parametrize("controller,mode", [pytest.param(c, m, marks=[HVD] if c in ("gloo", "mpi") else [])
                                             for c in ("gloo", "mpi", "torchrun", "mpi-torch") for m in ("kill", "hang")
                                             if not (c == "mpi-torch" and m == "hang")])   # = torchrun's hang
def test_dead_or_silent_rank_fails_within_timeout_and_leaves_nothing(controller, mode):
    """Rank 1 dies with SIGKILL, or stops answering; rank 0 waits in an allreduce. The
    launcher may notice (horovodrun and mpirun abort the job when a rank dies); when it
    does not (a silent rank under Gloo hangs forever) the harness kills the whole tree at
    its timeout. Either way: an error with both ranks' output within the timeout, and no
    process left behind."""
    timeout = 15      # the ranks start in ~5 s; the harness kills a silent job at 15
    t0 = time.monotonic()
    with pytest.raises(MultiRankError) as ei:
        run_ranks(ROOT / "tests/ranks/die.py", controller=controller, np=2, timeout=timeout,
                  args=[mode])
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert elapsed < timeout + 15, elapsed
    assert f"rank 1 about to {'die' if mode == 'kill' else 'hang'}" in msg
    assert "rank 0 entering allreduce" in msg
    time.sleep(0.5)
    assert _leftovers("tests/ranks/die.py") == []


# ------------------------------------------------------------------------ engine selection
_LAUNCH_VARS = ("HOROVOD_RANK", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARLE_HVD_ENGINE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS",
                "SLURM_NNODES", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def bare_env(monkeypatch):
    for k in list(__import__("os").environ):
        if k in _LAUNCH_VARS or k.startswith("OMPI_COMM_WORLD"):
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
