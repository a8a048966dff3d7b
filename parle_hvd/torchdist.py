"""The torch.distributed engine behind comm.py (``dist.engine=torch``), and the only module
in parle_hvd that calls torch.distributed.

    torchrun --nproc-per-node 2 train.py --config configs/fashion_parle.yaml
    launch/torchrun.sh                                   # the same, through our launcher
    NNODES=2 NODE_RANK=0 RDZV=node1:29400 launch/torchrun.sh   # on each of two nodes
    mpirun -np 4 python train.py ... dist.engine=torch   # OpenMPI's variables (or srun's)

comm.py packs the buffers and keeps the counters; this module only moves them. It runs
the same wire formats as Horovod's engine: one ``all_reduce`` (sum) of one flat buffer per
sync, asynchronous when the sync overlaps, and one ``broadcast`` of raw bytes. Gloo carries
CPU tensors, NCCL CUDA tensors (Gloo too with ``dist.share_device``, where NCCL refuses
two ranks on one GPU). Data-parallel SGD uses DistributedDataParallel (gradient buckets
allreduced during the backward pass) with a communication hook that counts each bucket,
and compresses it to float16 with ``dpsgd.fp16``.

Where the world comes from, first match wins:
  torchrun / the env:// convention   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT
  OpenMPI (mpirun)                   OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
  MVAPICH (mpirun_rsh)               MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
  SLURM (srun)                       the step's: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID,
                                     SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID, SLURM_STEP_NODELIST
                                     (slurm.py; the job's variables where the step's are absent)
  MPICH / Intel MPI (hydra)          PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
PMIx alone (PMIX_RANK, no task count) is refused with one line, never taken for a world of 1.
Without MASTER_ADDR, a job on one host uses 127.0.0.1 and a SLURM job its step's first node;
without MASTER_PORT, a port derived from the job's id (so two jobs on one host differ).
"""
from __future__ import annotations

import datetime
import os
import zlib

import torch
import torch.distributed as dist

from . import slurm


class WorldError(RuntimeError):
    """The environment does not say enough to form the world (one line for the user)."""


def torchrun_launched() -> bool:
    """True when torchrun (or anything following its env:// convention) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _port(job_id: str) -> str:
    return str(20000 + zlib.crc32(job_id.encode()) % 20000)


def _pmi_over_srun(e) -> bool:
    """MPICH's or Intel MPI's mpiexec inside an allocation starts its proxies with srun: the
    ranks inherit the proxies' step (a task per node) beside their own PMI_RANK/PMI_SIZE,
    which are then the truth. (Under srun --mpi=pmi2 the two agree.)"""
    try:
        return "PMI_SIZE" in e and int(e["PMI_SIZE"]) != slurm.step_layout(e)["size"]
    except (ValueError, slurm.SlurmError):
        return "PMI_SIZE" in e


def world_from_env() -> dict:
    """rank, size, local_rank, local_size, addr, port, source: from the launcher's variables."""
    e = os.environ
    if torchrun_launched():
        w = dict(rank=int(e["RANK"]), size=int(e["WORLD_SIZE"]), local_rank=int(e.get("LOCAL_RANK", 0)),
                 local_size=int(e.get("LOCAL_WORLD_SIZE", 1)), source="torchrun", job=e.get("TORCHELASTIC_RUN_ID", ""))
        one_host = w["size"] == w["local_size"]
    elif "OMPI_COMM_WORLD_RANK" in e:
        w = dict(rank=int(e["OMPI_COMM_WORLD_RANK"]), size=int(e["OMPI_COMM_WORLD_SIZE"]),
                 local_rank=int(e.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                 local_size=int(e.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)), source="OpenMPI",
                 job=e.get("OMPI_MCA_ess_base_jobid", e.get("OMPI_MCA_orte_ess_jobid", "")))
        one_host = w["size"] == w["local_size"]
    elif "MV2_COMM_WORLD_RANK" in e:
        w = dict(rank=int(e["MV2_COMM_WORLD_RANK"]), size=int(e["MV2_COMM_WORLD_SIZE"]),
                 local_rank=int(e.get("MV2_COMM_WORLD_LOCAL_RANK", 0)),
                 local_size=int(e.get("MV2_COMM_WORLD_LOCAL_SIZE", 1)), source="MVAPICH",
                 job=e.get("MPIRUN_ID", e.get("MV2_MPIRUN_ID", "")))
        one_host = w["size"] == w["local_size"]
    elif "SLURM_PROCID" in e and "SLURM_STEP_ID" in e and not _pmi_over_srun(e):
        # the step's layout, not the job's: a step may run on part of the allocation
        try:
            st = slurm.step_layout(e)
        except slurm.SlurmError as err:
            raise WorldError(f"dist.engine=torch under srun: {err}") from None
        w = dict(rank=st["rank"], size=st["size"], local_rank=st["local_rank"], local_size=st["local_size"],
                 source="SLURM", job=f"{e.get('SLURM_JOB_ID', '')}.{e.get('SLURM_STEP_ID', '')}")
        one_host = st["nodes"] == 1
        if not one_host and "MASTER_ADDR" not in e:
            try:
                e["MASTER_ADDR"] = slurm.first_node_addr(st["nodelist"])
            except slurm.SlurmError as err:
                raise WorldError(f"dist.engine=torch under srun on several nodes: {err}; export MASTER_ADDR") from None
    elif "PMI_RANK" in e:
        w = dict(rank=int(e["PMI_RANK"]), size=int(e["PMI_SIZE"]), local_rank=int(e.get("MPI_LOCALRANKID", 0)),
                 local_size=int(e.get("MPI_LOCALNRANKS", 1)), source="PMI", job=e.get("PMI_ID", ""))
        one_host = w["size"] == w["local_size"]
    elif "PMIX_RANK" in e:          # PMIx states the rank but no task count in the environment
        raise WorldError("dist.engine=torch: launched through PMIx (PMIX_RANK) without a task count it can read; "
                         "launch with srun, mpirun or torchrun (launch/torchrun.sh), or export RANK, WORLD_SIZE "
                         "and MASTER_ADDR")
    else:
        w = dict(rank=0, size=1, local_rank=0, local_size=1, source="none", job="")
        one_host = True
    addr = e.get("MASTER_ADDR") or ("127.0.0.1" if one_host else None)
    if addr is None:
        raise WorldError(f"dist.engine=torch on several hosts under {w['source']}: export MASTER_ADDR (the host of "
                         f"rank 0) and MASTER_PORT, or launch with torchrun (launch/torchrun.sh)")
    w.update(addr=addr, port=e.get("MASTER_PORT") or _port(f"{w['source']}:{w['job']}"))
    return w


class TorchEngine:
    """One process group for the job; the operations comm.py needs, by its names."""
    name = "torch"

    def __init__(self, timeout: float = 0.0, gpu_backend: str = "nccl"):
        w = world_from_env()
        self.w = w
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(w["local_rank"] % torch.cuda.device_count())
        self.backend = f"cpu:gloo,cuda:{gpu_backend}" if cuda else "gloo"
        # dist.timeout: the trainer's watchdog names a silent rank first; Gloo's own timeout
        # comes a minute later (0 = wait forever, as in Horovod).
        secs = timeout + 60 if timeout > 0 else 365 * 86400
        if not dist.is_initialized():
            td = datetime.timedelta(seconds=secs)
            # Under torchrun the agent hosts the store and keeps it across restarts: each
            # restart's keys get their own prefix, or a restarted rank could read the address
            # a dead one published (seen here: "connectFullMesh failed ... Connection refused").
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            # (the store waits at most 30 min for every rank to arrive, torch's own default)
            try:
                store = dist.TCPStore(w["addr"], int(w["port"]), w["size"], is_master=not agent and w["rank"] == 0,
                                      timeout=min(td, datetime.timedelta(minutes=30)), multi_tenant=not agent)
            except dist.DistNetworkError as e:
                if "EADDRINUSE" not in str(e):
                    raise
                # No retry on another port: the other ranks derive the same one and would
                # wait at it for 30 minutes.
                how = "MASTER_PORT" if os.environ.get("MASTER_PORT") else f"derived from the job id ({w['source']})"
                raise WorldError(f"dist.engine=torch: port {w['port']} on {w['addr']} ({how}) is already in use "
                                 f"by another process; export MASTER_PORT=<a free port> on every rank") from None
            store = dist.PrefixStore(f"parle_hvd/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
            dist.init_process_group(self.backend, store=store, rank=w["rank"], world_size=w["size"], timeout=td)
        self.gpu_backend = gpu_backend if cuda else None

    def rank(self) -> int:
        return dist.get_rank()

    def size(self) -> int:
        return dist.get_world_size()

    def local_rank(self) -> int:
        return self.w["local_rank"]

    def local_size(self) -> int:
        return self.w["local_size"]

    def controller(self) -> str:
        return "gloo" if self.gpu_backend is None else f"gloo+{self.gpu_backend}"

    # ---------------------------------------------------------------- collectives (all ranks reach each)
    def allreduce_sum_start(self, flat: torch.Tensor, name: str):
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)      # all ranks reach this

    def allreduce_wait(self, handle, flat: torch.Tensor) -> torch.Tensor:
        handle.wait()
        return flat

    def allreduce_mean(self, t: torch.Tensor, name: str) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)                              # all ranks reach this
        return out.div_(self.size())

    def broadcast(self, flat: torch.Tensor, root: int, name: str) -> torch.Tensor:
        dist.broadcast(flat, src=root)                                          # all ranks reach this
        return flat

    def data_parallel(self, model, opt, *, fp16: bool, bucket_mb: float, count):
        """DistributedDataParallel around ``model``; ``opt`` is returned unchanged (the
        averaging happens in backward). ``count(calls, bytes)`` is told of every bucket.
        No collective at construction (init_sync off: the trainer has already broadcast
        rank 0's weights, counted) and none per forward (forward_sync_buffers off: BatchNorm
        statistics stay per rank, as with Horovod's DistributedOptimizer). DDP's first step
        uses its initial buckets, later steps the ones it rebuilds from the order gradients
        arrived in: the count of allreduces per step may change once, the bytes never."""
        from torch.nn.parallel import DistributedDataParallel

        dev = next(model.parameters()).device
        ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      init_sync=False, forward_sync_buffers=False, bucket_cap_mb=bucket_mb,
                                      gradient_as_bucket_view=True)
        world = self.size()

        def hook(_state, bucket):
            buf = bucket.buffer()
            wire = buf.to(torch.float16) if fp16 and buf.dtype in (torch.float32, torch.float64) else buf
            count(1, wire.numel() * wire.element_size())
            wire.div_(world)                    # DDP's own order: divide, then sum
            fut = dist.all_reduce(wire, async_op=True).get_future()   # all ranks reach this, bucket by bucket

            def done(f):
                out = f.value()[0]
                if out is not buf:
                    buf.copy_(out)
                return buf
            return fut.then(done)

        ddp.register_comm_hook(None, hook)
        return ddp, opt

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

