"""Every collective parle_hvd performs, through one of two engines: Horovod (this module is
the only one that imports horovod.torch) or torch.distributed (torchdist.py, the only
module that calls it).

Why one module: ranks must call collectives in the same order and the same number of
times, or the job hangs. Keeping them all here makes that auditable, lets the rest of the
package (models, math, data) import nothing distributed, and gives one place to count
what crosses the network. Both engines carry the same buffers, so the counters and the
results are the same whichever carries them.

Which engine (``dist.engine``; the environment's ``PARLE_HVD_ENGINE`` when that is auto):
* ``horovod``: under horovodrun, mpirun or srun. ``auto`` picks it there whenever Horovod
  imports.
* ``torch``: under torchrun (which Horovod cannot join), or mpirun/srun without Horovod,
  or when asked. torchdist.py reads the world from the launcher's variables.
At world size 1 without a launcher, neither is imported or initialised and every
collective returns its input untouched (and counts nothing: nothing was sent).

Wire formats:
* ``fused_allreduce_`` packs every tensor into ONE flat buffer and issues ONE allreduce
  (op Sum; ``fused_allreduce_start`` the same, asynchronous, waited on later through the
  ``Pending`` it returns), then divides the "mean" part by the world size, so the result
  is the exact mean of the ranks' values (one rounding, like a single division).
  The buffer's dtype is the promotion of the inputs' dtypes, at least float32 (bfloat16
  and float16 are averaged in float32, which is exact for them and avoids depending on
  half-precision CPU kernels); integer tensors force float64 and are rounded back to the
  nearest integer.
* ``broadcast_`` packs every tensor's raw bytes into one uint8 buffer: exact for every
  dtype, one call.
* ``broadcast_object`` pickles, then broadcasts the length and the payload: two calls.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

_eng = None          # the engine once initialised (_Horovod or torchdist.TorchEngine), else None
_init_called = False  # init() ran (with backend "none", a launched process may knowingly run alone)
_launched_env = ("HOROVOD_RANK", "HOROVOD_ELASTIC", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                 "MV2_COMM_WORLD_SIZE")
ENGINES = ("auto", "horovod", "torch")


class EngineError(RuntimeError):
    """The engine asked for cannot run here (one line for the user)."""


@dataclass
class CommStats:
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    broadcast_calls: int = 0
    broadcast_bytes: int = 0

    @property
    def calls(self) -> int:
        return self.allreduce_calls + self.broadcast_calls

    @property
    def bytes(self) -> int:
        return self.allreduce_bytes + self.broadcast_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(calls=self.calls, bytes=self.bytes)
        return d


_stats = CommStats()


def launched() -> bool:
    """True when a launcher (horovodrun, mpirun, srun with PMI/PMIx, torchrun) started this process."""
    from .torchdist import torchrun_launched
    if any(k in os.environ for k in _launched_env) or torchrun_launched():
        return True
    return "SLURM_STEP_ID" in os.environ and stated_world()[1] > 1   # srun without PMI


_MPI_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def _srun_without_pmi() -> bool:
    """srun started several tasks but gave them no MPI world (--mpi=none): Horovod's MPI
    would make every task rank 0 of a world of 1; torch.distributed reads SLURM's variables.
    (Not under torchrun, whose workers inherit the step's variables; not with Intel MPI's
    I_MPI_PMI_LIBRARY, whose MPI reads SLURM's own PMI library.)"""
    from .torchdist import torchrun_launched
    return ("SLURM_STEP_ID" in os.environ and (stated_world() or ("", 1))[1] > 1 and not torchrun_launched()
            and not any(k in os.environ for k in (*_MPI_ENV, "I_MPI_PMI_LIBRARY")))


def _mpi_is_openmpi() -> bool:
    """Whether the MPI that Horovod and mpi4py were built against (launch/setup.sh builds
    both with the same mpicc) is OpenMPI, whose MPI_Init aborts in a step without PMI. An
    MPI built with SLURM's PMI-1 library (MPICH, MVAPICH2 --with-pmi=slurm) sees the step
    there, and the world check after init judges it. Unknown: assume OpenMPI."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False          # a question, not an MPI_Init
        from mpi4py import MPI
        return MPI.Get_library_version().lstrip().startswith("Open MPI")
    except Exception:                         # noqa: BLE001 - no mpi4py, or it does not load
        return True


def stated_world() -> Optional[tuple]:
    """(launcher, task count, this task's rank) as the launcher that started this process
    states them in the environment, or None where none does (no launcher; horovodrun's
    elastic mode, whose world changes). PMIx exports a rank but no count (count None).
    The engine's world must be this one."""
    try:
        return _stated_world(os.environ)
    except (ValueError, KeyError) as err:      # a malformed launcher variable: one line, not a traceback
        raise EngineError(f"cannot read the launcher's world from the environment ({err})") from None


def _stated_world(e) -> Optional[tuple]:
    from .torchdist import torchrun_launched
    if "HOROVOD_RANK" in e:
        if "HOROVOD_ELASTIC" in e or "HOROVOD_SIZE" not in e:
            return None
        return ("horovodrun", int(e["HOROVOD_SIZE"]), int(e["HOROVOD_RANK"]))
    if torchrun_launched():
        return ("torchrun", int(e["WORLD_SIZE"]), int(e["RANK"]))
    for size, rank, who in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OpenMPI (mpirun)"),
                            ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MVAPICH"),
                            ("PMI_SIZE", "PMI_RANK", "PMI (MPICH, Intel MPI)")):
        if size in e:
            return (who, int(e[size]), int(e.get(rank, 0)))
    if "SLURM_STEP_ID" in e:
        from .slurm import step_layout
        st = step_layout(e)
        return ("SLURM (srun)", st["size"], st["rank"])
    if "PMIX_RANK" in e:
        return ("PMIx", None, int(e["PMIX_RANK"]))
    return None


def _check_world(name: str) -> None:
    """After init: the world formed must be the one the launcher started, or n processes
    would each train alone as rank 0 and write the same files (one line, before any file)."""
    want = stated_world()
    if want is None:
        return
    who, n, r = want
    if (n is None or n == _eng.size()) and r == _eng.rank():
        return
    if name == "horovod" and who.startswith("SLURM"):
        fix = "launch with srun --mpi=pmix (so that MPI sees the step), or use dist.engine=torch"
    elif name == "horovod":
        fix = ("this Horovod's MPI is not the launcher's (Horovod here joins horovodrun and the MPI it was built "
               "with); use dist.engine=torch, or a Horovod built against this MPI")
    else:
        fix = "launch with torchrun (launch/torchrun.sh), or export RANK, WORLD_SIZE and MASTER_ADDR"
    started = f"{n} tasks" if n is not None else "this task"
    raise EngineError(f"{who} started {started} (this one rank {r}), but the {name} engine made it rank "
                      f"{_eng.rank()} of a world of {_eng.size()} (tasks would train alone as rank 0): {fix}")


def horovod_available() -> bool:
    try:
        import horovod.torch  # noqa: F401  (a probe; _Horovod imports it for use)
        return True
    except (ImportError, OSError):     # not installed, or built against another torch
        return False


def resolve_engine(engine: str = "auto") -> str:
    """The engine a launched process uses: ``engine``, or for auto the environment's
    PARLE_HVD_ENGINE, or what the launcher allows (Horovod when it imports, except under
    torchrun). Raises EngineError when the launcher and the engine do not go together."""
    if engine not in ENGINES:
        raise EngineError(f"dist.engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "auto":
        engine = os.environ.get("PARLE_HVD_ENGINE", "auto") or "auto"
        if engine not in ENGINES:
            raise EngineError(f"PARLE_HVD_ENGINE must be one of {', '.join(ENGINES)}, not {engine!r}")
    from .torchdist import torchrun_launched
    under_torchrun = torchrun_launched() and "HOROVOD_RANK" not in os.environ
    if engine == "auto":
        if under_torchrun or _srun_without_pmi():
            return "torch"
        return "horovod" if "HOROVOD_RANK" in os.environ or horovod_available() else "torch"
    if engine == "horovod" and under_torchrun:
        raise EngineError("dist.engine=horovod: this process was started by torchrun, which Horovod cannot join; "
                          "launch with horovodrun or mpirun, or use dist.engine=torch")
    if engine == "torch" and "HOROVOD_RANK" in os.environ:
        raise EngineError("dist.engine=torch: this process was started by horovodrun, whose ranks only Horovod "
                          "joins; launch with torchrun (launch/torchrun.sh), mpirun or srun")
    if engine == "horovod" and _srun_without_pmi() and _mpi_is_openmpi():
        # (checked before init: OpenMPI's MPI_Init aborts under such a step, or forms a world of 1)
        raise EngineError(f"dist.engine=horovod: srun started {stated_world()[1]} tasks without PMI (--mpi=none), so "
                          f"MPI cannot see the step and each task would train alone; launch with srun --mpi=pmix, "
                          f"or use dist.engine=torch")
    if engine == "horovod" and not horovod_available():
        raise EngineError("dist.engine=horovod: Horovod is not installed (make setup builds it; "
                          "PARLE_HVD_ENGINE=torch make setup skips it); use dist.engine=torch")
    return engine


class _Horovod:
    """Horovod's operations by the names comm.py uses (torchdist.TorchEngine has the same)."""
    name = "horovod"

    def __init__(self, timeout: float = 0.0):
        if timeout > 0:
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(int(min(60, timeout))))
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(timeout)))
        import horovod.torch as hvd  # the one import of horovod.torch in parle_hvd

        hvd.init()
        self.hvd = hvd

    def rank(self) -> int:
        return self.hvd.rank()

    def size(self) -> int:
        return self.hvd.size()

    def local_rank(self) -> int:
        return self.hvd.local_rank()

    def local_size(self) -> int:
        return self.hvd.local_size()

    def controller(self) -> str:
        return "mpi" if self.hvd.mpi_enabled() else "gloo"

    def allreduce_sum_start(self, flat, name):
        return self.hvd.allreduce_async(flat, op=self.hvd.Sum, name=f"parle_hvd.{name}")   # all ranks reach this

    def allreduce_wait(self, handle, flat):
        return self.hvd.synchronize(handle)

    def allreduce_mean(self, t, name):
        return self.hvd.allreduce(t.detach(), op=self.hvd.Average, name=f"parle_hvd.{name}")   # all ranks reach this

    def broadcast(self, flat, root, name):
        return self.hvd.broadcast(flat, root_rank=root, name=f"parle_hvd.{name}")   # all ranks reach this

    def data_parallel(self, model, opt, *, fp16: bool, bucket_mb: float, count, accum: int = 1):
        """Horovod's DistributedOptimizer: gradients allreduced in backward hooks (after
        ``accum`` backward passes: ``backward_passes_per_step``), waited for in
        ``synchronize()`` (which ``step()`` calls); the model is used as it is. ``count`` is
        told, at each wait, of one allreduce per parameter tensor (Horovod's API calls; its
        tensor fusion may merge them on the wire) and their bytes (2 per element with fp16)."""
        hvd = self.hvd
        named = list(model.named_parameters())
        comp = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        dopt = hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp, op=hvd.Average,
                                        backward_passes_per_step=accum)
        params = [p for _, p in named if p.requires_grad]
        per_step = sum(p.numel() * (2 if fp16 and p.is_floating_point() and p.element_size() > 2 else p.element_size())
                       for p in params)
        wait = dopt.synchronize

        def synchronize():
            out = wait()                        # all ranks reach this (waits for the hooks' allreduces)
            count(len(params), per_step)
            return out

        dopt.synchronize = synchronize
        return model, dopt

    def shutdown(self) -> None:
        self.hvd.shutdown()

    def peer_left(self, e: BaseException) -> bool:
        return isinstance(e, self.hvd.HorovodInternalError)


def init(backend: str = "auto", set_threads: bool = True, timeout: float = 0.0, engine: str = "auto",
         gpu_backend: str = "nccl") -> None:
    """Join the job's world when a launcher started this process (``backend="auto"``),
    always (``"horovod"``: Horovod even without a launcher) or never (``"none"``; world
    size 1), through ``engine`` (``resolve_engine``). Idempotent. ``timeout`` > 0 sets
    Horovod's stall warning (60 s) and stall shutdown (``timeout``) unless the environment
    already does, or Gloo's timeout a minute after it under torch.distributed; the
    trainer's watchdog acts first. ``gpu_backend``: torch.distributed's for CUDA tensors."""
    global _eng, _init_called
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # a DataLoader worker started by forkserver or spawn imports the main script again
        raise EngineError("a DataLoader worker (data.worker_start=forkserver or spawn; auto in a multi-rank job) ran the "
                          "training script again: put its code under `if __name__ == \"__main__\":`, or set "
                          "data.worker_start=fork")
    if backend not in ("auto", "horovod", "none"):
        raise ValueError(f"dist.backend must be auto, horovod or none, not {backend!r}")
    if _eng is None and (backend == "horovod" or (backend == "auto" and launched())):
        name = "horovod" if backend == "horovod" else resolve_engine(engine)
        if name == "horovod":
            _eng = _Horovod(timeout)
        else:
            from .torchdist import TorchEngine, WorldError
            try:
                _eng = TorchEngine(timeout, gpu_backend)
            except WorldError as e:
                raise EngineError(str(e)) from None
        _check_world(name)
        chose = engine == "auto" and os.environ.get("PARLE_HVD_ENGINE", "auto") in ("", "auto")
        if name == "torch" and chose and _srun_without_pmi() and _eng.rank() == 0:
            print(f"[parle_hvd] srun gave its {_eng.size()} tasks no MPI world (--mpi=none): dist.engine=torch "
                  f"chosen (SLURM's variables); srun --mpi=pmix lets Horovod join", file=sys.stderr, flush=True)
    _init_called = True
    if set_threads:
        set_threads_per_rank()


def set_threads_per_rank() -> None:
    """Ranks on one host share its cores; oversubscribed intra-op threads thrash."""
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_size()))


def is_initialized() -> bool:
    return _eng is not None


def init_called() -> bool:
    """Whether ``init`` ran in this process, whatever world it found."""
    return _init_called


def engine() -> str:
    """'horovod', 'torch', or 'none' (world size 1 without a launcher)."""
    return _eng.name if _eng else "none"


def rank() -> int:
    return _eng.rank() if _eng else 0


def size() -> int:
    return _eng.size() if _eng else 1


def local_rank() -> int:
    return _eng.local_rank() if _eng else 0


def local_size() -> int:
    return _eng.local_size() if _eng else 1


def controller() -> str:
    """Who carries the bytes: 'mpi' or 'gloo' (Horovod's controllers), 'gloo' or
    'gloo+nccl' (torch.distributed's backends), 'none' (no world joined: a single process
    without a launcher)."""
    return _eng.controller() if _eng else "none"


def _active() -> bool:
    return _eng is not None and _eng.size() > 1


def stats() -> CommStats:
    """The live counters (a copy)."""
    return CommStats(**asdict(_stats))


def reset_stats() -> None:
    global _stats
    _stats = CommStats()


def load_stats(d: dict) -> None:
    """Restore counters (e.g. from a checkpoint) so a resumed run reports its total."""
    global _stats
    _stats = CommStats(**{k: int(d[k]) for k in asdict(_stats)})


def _count_allreduce(calls: int, nbytes: int) -> None:
    _stats.allreduce_calls += calls
    _stats.allreduce_bytes += nbytes


def _wire_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    dt = torch.float32
    for t in tensors:
        if not (t.is_floating_point()):
            return torch.float64
        dt = torch.promote_types(dt, t.dtype)
    return dt


class Pending:
    """A fused allreduce in flight (``fused_allreduce_start``); ``wait()`` completes it."""

    def __init__(self, flat: torch.Tensor, handle, means: list, sums: list, n_mean: int):
        self.flat, self.handle, self.means, self.sums, self.n_mean = flat, handle, means, sums, n_mean
        self.done = False

    def wait(self) -> None:
        """Block until the allreduce is complete, then write the result into the tensors
        the call named (means, then sums). Once; a second call does nothing."""
        if self.done:
            return
        flat = self.flat
        if self.handle is not None:
            flat = _eng.allreduce_wait(self.handle, flat)   # the same call on every rank: the one started
            if self.n_mean:
                flat[:self.n_mean].div_(_eng.size())
        off = 0
        for t in self.means + self.sums:
            seg = flat[off:off + t.numel()].view_as(t)
            if not t.is_floating_point():
                seg = seg.round()
            with torch.no_grad():
                t.copy_(seg)
            off += t.numel()
        self.done = True


def fused_allreduce_start(means: Sequence[torch.Tensor] = (), sums: Sequence[torch.Tensor] = (), *,
                          name: str = "fused", out_means: Sequence[torch.Tensor] | None = None) -> Pending:
    """Start ONE allreduce of every tensor in ``means`` (to be averaged) and ``sums`` (to be
    summed), through one flat buffer, and return at once. The tensors' values are copied
    into the buffer now, so the caller may change them while the allreduce runs (in
    Horovod's background thread); ``Pending.wait()`` writes the result into ``out_means``
    (default: ``means``) and ``sums``. All ranks reach this with the same shapes, dtypes and
    order, and each waits for it before its next collective of the same name, or the job hangs."""
    means, sums = list(means), list(sums)
    outs = list(out_means) if out_means is not None else means
    tensors = means + sums
    if not tensors:
        return Pending(torch.zeros(0), None, [], [], 0)
    device = tensors[0].device
    wire = _wire_dtype(tensors)
    n_mean = sum(t.numel() for t in means)
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=wire) for t in tensors])
    if not _active():
        return Pending(flat, None, outs, sums, n_mean)
    handle = _eng.allreduce_sum_start(flat, name)   # all ranks reach this
    _count_allreduce(1, flat.numel() * flat.element_size())
    return Pending(flat, handle, outs, sums, n_mean)


def fused_allreduce_(means: Sequence[torch.Tensor] = (), sums: Sequence[torch.Tensor] = (),
                     *, name: str = "fused") -> None:
    """In place: every tensor in ``means`` becomes the mean over ranks, every tensor in
    ``sums`` the sum over ranks, through one flat buffer and one allreduce (the blocking
    form of ``fused_allreduce_start``). At world size 1, nothing changes.

    All ranks reach this with the same shapes, dtypes and order, or the job hangs.
    """
    if not _active():
        return
    fused_allreduce_start(means, sums, name=name).wait()   # all ranks reach this


def allreduce_mean_(tensors: Sequence[torch.Tensor], *, name: str = "mean") -> None:
    """In place, the exact mean over ranks of each tensor; one fused call. All ranks reach this."""
    fused_allreduce_(means=tensors, name=name)


def allreduce_sum_(tensors: Sequence[torch.Tensor], *, name: str = "sum") -> None:
    """In place, the sum over ranks of each tensor; one fused call. All ranks reach this."""
    fused_allreduce_(sums=tensors, name=name)


def allreduce_each_(tensors: Sequence[torch.Tensor], *, name: str = "each") -> None:
    """In place, the mean over ranks of each tensor with ONE ``hvd.allreduce`` PER TENSOR
    (the unfused way; bench/sync_cost.py compares it with ``fused_allreduce_``). All ranks
    reach this, with the same tensors in the same order."""
    if not _active():
        return
    for i, t in enumerate(tensors):
        out = _eng.allreduce_mean(t, f"{name}.{i}")   # all ranks reach this
        _count_allreduce(1, out.numel() * out.element_size())
        with torch.no_grad():
            t.copy_(out)


def broadcast_(tensors: Sequence[torch.Tensor], root: int = 0, *, name: str = "bcast") -> None:
    """In place, every tensor takes rank ``root``'s values (bit-exact, any dtype); one call.
    All ranks reach this."""
    tensors = list(tensors)
    if not tensors or not _active():
        return
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tensors])
    # all ranks reach this
    flat = _eng.broadcast(flat, root, name)
    _stats.broadcast_calls += 1
    _stats.broadcast_bytes += flat.numel()
    off = 0
    for t in tensors:
        nb = t.numel() * t.element_size()
        seg = flat[off:off + nb].view(t.dtype).view_as(t)
        with torch.no_grad():
            t.copy_(seg.to(t.device))
        off += nb


def broadcast_object(obj: Any = None, root: int = 0, *, name: str = "obj") -> Any:
    """Rank ``root``'s picklable ``obj`` on every rank; two calls (length, payload).
    All ranks reach this."""
    if not _active():
        return obj
    payload = pickle.dumps(obj) if rank() == root else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_([length], root, name=f"{name}.len")  # all ranks reach this
    buf = torch.zeros(int(length.item()), dtype=torch.uint8)
    if rank() == root:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    broadcast_([buf], root, name=f"{name}.data")  # all ranks reach this
    return pickle.loads(buf.numpy().tobytes())


def data_parallel(model: torch.nn.Module, opt: torch.optim.Optimizer, *, fp16: bool = False,
                  bucket_mb: float = 25.0, accum: int = 1):
    """Data-parallel SGD's wrapping, by engine: returns ``(module, optimizer)``; train with
    ``module(x)`` and ``optimizer.step()``. Horovod: the model as it is and Horovod's
    DistributedOptimizer (an allreduce per gradient tensor, every step, counted at
    ``step()``). torch: DistributedDataParallel (gradient buckets of ``bucket_mb`` MB
    allreduced during backward, each bucket counted as it goes) and the optimizer as it
    is. ``fp16`` halves the gradients' bytes on the wire. ``accum``: backward passes per
    step (gradient accumulation; DDP: all but the last inside ``module.no_sync()``). At
    world size 1 both are returned as they are. All ranks run the same steps."""
    if not _active():
        return model, opt
    if _eng.name == "horovod":
        return _eng.data_parallel(model, opt, fp16=fp16, bucket_mb=bucket_mb, count=_count_allreduce, accum=accum)
    return _eng.data_parallel(model, opt, fp16=fp16, bucket_mb=bucket_mb, count=_count_allreduce)


# --------------------------------------------------------------------------- elastic mode
def elastic_launched() -> bool:
    """True when horovodrun started this process in elastic mode (--min-np, discovery script)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this job's workers (0 elsewhere)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def elastic_state(*, save, restore, sync, reset):
    """A Horovod elastic state whose save/restore/sync/reset are the trainer's callbacks.

    It departs from Horovod's ``State.commit`` in one way: Horovod checks for host changes
    with two broadcasts at every commit; here the coordinator (rank 0, the only worker the
    driver notifies) reads its notifications with ``host_update_pending()`` and sends the
    answer inside the sync allreduce, and ``commit(update)`` raises Horovod's
    HostsUpdatedInterrupt on every rank alike. So elastic mode adds no collective."""
    from horovod.common.elastic import State
    from horovod.common.exceptions import HostsUpdatedInterrupt

    class _State(State):
        def __init__(self):
            super().__init__(bcast_object=broadcast_object, get_rank=rank)

        def save(self):
            save()

        def restore(self):
            restore()

        def sync(self):
            sync()

        def reset(self):
            reset()

        def host_update_pending(self) -> int:
            """Local: the host changes the driver announced since the last call, as Horovod's
            HostUpdateResult bits (1 removed, 2 added), or 0."""
            update = 0
            while not self._host_messages.empty():
                ts, res = self._host_messages.get()
                if ts > self._last_updated_timestamp:
                    self._last_updated_timestamp = ts
                    update |= int(res)
            return update

        def commit(self, update: int = 0) -> None:
            """Save; then, if any rank reported a host change (``update``, the same on every
            rank), interrupt so that Horovod re-forms the world. Removals alone skip the
            state sync (the survivors already agree)."""
            self.save()
            if update:
                raise HostsUpdatedInterrupt(update == 1)

    return _State()


def elastic_run(fn, state, *args, **kwargs):
    """``hvd.elastic.run``: call ``fn(state, ...)``; when a rank fails (HorovodInternalError)
    restore the last commit, re-form the world and sync; when hosts change (interrupt raised
    by ``state.commit``) re-form the world and sync. Returns ``fn``'s result."""
    return _eng.hvd.elastic.run(fn)(state, *args, **kwargs)


def peer_left(e: BaseException) -> bool:
    """Whether ``e`` is the engine's word that it shut down in a collective because another
    rank left the job (Horovod's HorovodInternalError outside elastic mode's recovery)."""
    return _eng is not None and getattr(_eng, "peer_left", lambda _: False)(e)


def shutdown() -> None:
    """Leave the world without a barrier (a barrier would hang if a rank already died)."""
    global _eng
    if _eng is not None:
        _eng.shutdown()
        _eng = None


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = [
    "CommStats", "launched", "init", "is_initialized", "rank", "size", "local_rank", "local_size",
    "controller", "stats", "reset_stats", "load_stats", "fused_allreduce_", "allreduce_mean_",
    "allreduce_sum_", "allreduce_each_", "broadcast_", "broadcast_object", "data_parallel", "shutdown", "nbytes",
    "engine", "resolve_engine", "horovod_available", "EngineError", "ENGINES",
    "elastic_launched", "elastic_state", "elastic_run",
]
