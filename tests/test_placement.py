"""GPU placement under every launcher (assemble.pick_device), with mocked device counts:
one visible device per rank is cuda:0, several are taken by local rank, fewer devices than
ranks on a host is an error unless dist.share_device."""
import pytest
import torch

from parle_hvd import assemble
from parle_hvd.assemble import gpu_index, local_place, pick_device
from parle_hvd.rundir import RunError

LAUNCH_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",
               "MPI_LOCALNRANKS", "SLURM_LOCALID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES",
               "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_TASKS_PER_NODE",
               "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_NPROCS", "CUDA_VISIBLE_DEVICES")

OMPI = {"OMPI_COMM_WORLD_LOCAL_RANK": "{r}", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
SLURM = {"SLURM_LOCALID": "{r}", "SLURM_PROCID": "{r}", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
TORCHRUN = {"LOCAL_RANK": "{r}", "LOCAL_WORLD_SIZE": "4"}


@pytest.fixture
def gpus(monkeypatch):
    """A host whose every rank sees ``n`` CUDA devices; returns a setter, and the device set."""
    for v in LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(i))

    def visible(n):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible, chosen


@pytest.mark.parametrize("launcher", [OMPI, SLURM, TORCHRUN], ids=["openmpi", "slurm", "torchrun"])
@pytest.mark.parametrize("r", [0, 3])
def test_one_visible_device_per_rank_is_cuda0(gpus, monkeypatch, launcher, r):
    """SLURM --gpus-per-task=1 (or any per-rank binding): 4 ranks on the host, each seeing
    one device through CUDA_VISIBLE_DEVICES; each takes cuda:0."""
    visible, chosen = gpus
    for k, v in launcher.items():
        monkeypatch.setenv(k, v.format(r=r))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(r))
    visible(1)
    assert local_place() == (r, 4)
    assert pick_device("cuda") == torch.device("cuda", 0) and chosen == [0]
    assert pick_device("auto") == torch.device("cuda", 0)


@pytest.mark.parametrize("launcher", [OMPI, SLURM, TORCHRUN], ids=["openmpi", "slurm", "torchrun"])
def test_all_devices_visible_are_taken_by_local_rank(gpus, monkeypatch, launcher):
    visible, chosen = gpus
    visible(4)
    for r in range(4):
        for k, v in launcher.items():
            monkeypatch.setenv(k, v.format(r=r))
        assert pick_device("cuda") == torch.device("cuda", r)
    assert chosen == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")      # the job's GPUs, renumbered 0..3 by CUDA
    assert pick_device("cuda") == torch.device("cuda", 3)


@pytest.mark.parametrize("launcher", [OMPI, SLURM, TORCHRUN], ids=["openmpi", "slurm", "torchrun"])
def test_more_ranks_than_devices_is_an_error_unless_shared(gpus, monkeypatch, launcher):
    visible, _ = gpus
    for k, v in launcher.items():
        monkeypatch.setenv(k, v.format(r=3))
    visible(2)
    with pytest.raises(RunError, match="4 ranks on this host but 2 GPU"):
        pick_device("cuda")
    assert pick_device("cuda", share=True) == torch.device("cuda", 1)
    visible(1)                    # one GPU in the host, seen by every rank: not a per-rank binding
    with pytest.raises(RunError, match="dist.share_device"):
        pick_device("cuda")
    assert pick_device("cuda", share=True) == torch.device("cuda", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    visible(2)
    with pytest.raises(RunError, match="4 ranks on this host but 2 GPU"):
        pick_device("cuda")


def test_single_rank_and_cpu(gpus, monkeypatch):
    visible, _ = gpus
    visible(1)
    assert pick_device("cuda") == torch.device("cuda", 0)      # no launcher: one rank
    visible(0)
    with pytest.raises(RunError, match="no GPU is visible"):
        pick_device("cuda")
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(RunError, match="is_available"):
        pick_device("cuda")


def test_gpu_index_table():
    # (visible, local rank, local size, CUDA_VISIBLE_DEVICES, share) -> device
    for args, want in [((8, 5, 8, None, False), 5), ((1, 2, 4, "2", False), 0), ((1, 0, 1, None, False), 0),
                       ((2, 3, 4, None, True), 1), ((4, 1, 2, "0,1,2,3", False), 1), ((2, 1, 2, " 3, 4", False), 1)]:
        n, r, s, vis, share = args
        assert gpu_index(n, r, s, visible=vis, share=share) == want, args
    with pytest.raises(RunError):
        gpu_index(1, 1, 2, visible="0,1", share=False)        # two named but one usable: not a binding
