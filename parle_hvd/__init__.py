"""parle_hvd: Parle (Chaudhari et al., arXiv 1707.00424) on Horovod/MPI or torch.distributed.

As a library, in a training script of your own (docs/api.md, examples/own_loop.py):

    import parle_hvd
    parle_hvd.init()                                     # every rank, whichever launcher started us
    opt = parle_hvd.optim.make("parle", model, lr=0.1, sync_period=25, batches_per_pass=len(loader))
    ...  loss.backward(); opt.step(); opt.zero_grad()  ...
    with opt.reference():
        evaluate(model)

As a trainer: ``horovodrun -np 2 python train.py --config configs/fashion_parle.yaml``.
"""

__version__ = "0.1.0"
__all__ = ["init", "rank", "size", "local_rank", "shutdown", "optim"]


def init(*, engine: str = "auto", timeout: float = 300.0, threads: bool = True, gpu_backend: str = "nccl") -> None:
    """Join the job as one replica: Horovod (horovodrun, mpirun, srun) or torch.distributed
    (torchrun), whichever launched this process (``engine="auto"``; or "horovod", "torch").
    ``timeout``: seconds a collective may wait for a silent peer before the job fails.
    ``threads``: give this rank its share of the host's cores. ``gpu_backend``: torch.distributed's
    for CUDA tensors ("nccl", or "gloo" when ranks share a GPU; CPU tensors always take Gloo).
    Without a launcher this process is a world of one. A launch whose world the engine cannot
    see raises ``parle_hvd.comm.EngineError`` with what to do, rather than train alone."""
    from . import comm
    comm.init("auto", set_threads=threads, timeout=timeout, engine=engine, gpu_backend=gpu_backend)


def rank() -> int:
    """This replica's rank in the job."""
    from . import comm
    return comm.rank()


def size() -> int:
    """The number of replicas in the job."""
    from . import comm
    return comm.size()


def local_rank() -> int:
    """This replica's rank on its host (which GPU it takes)."""
    from . import comm
    return comm.local_rank()


def shutdown() -> None:
    """Leave the job (at the end of a script)."""
    from . import comm
    comm.shutdown()


def __getattr__(name):           # parle_hvd.optim without importing torch for ``import parle_hvd``
    if name == "optim":
        import importlib
        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module 'parle_hvd' has no attribute {name!r}")
