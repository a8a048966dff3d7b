"""Run on 2 ranks under mpirun by bench/sync_cost.py: seconds per sync of a model's
weights, four ways, the same bytes each time: parle_hvd's fused allreduce through Horovod
(its MPI controller) and through torch.distributed (Gloo), Horovod's one allreduce per
tensor, and mpi4py's Allreduce of one numpy buffer. The four alternate within a round, in
the same processes, so the machine's noise falls on all of them alike."""
import json
import sys
import time

from mpi4py import MPI          # initialises MPI before Horovod, which then uses it
import numpy as np
import torch

from parle_hvd import comm
from parle_hvd.models import build_model, sync_tensors
from parle_hvd.torchdist import TorchEngine

have_hvd = comm.horovod_available()
comm.init(engine="horovod" if have_hvd else "torch")
# The same processes also join a torch.distributed group (OpenMPI's variables say who is
# who). comm.py talks to one engine at a time: the torch rows swap it in for their calls.
hvd_eng = comm._eng
torch_eng = TorchEngine() if have_hvd else comm._eng
torch.set_num_threads(1)
reps = int(sys.argv[1])
rounds = 5


def through(eng, f):
    def g():
        saved, comm._eng = comm._eng, eng
        try:
            f()
        finally:
            comm._eng = saved
    return g


out = {}
for name, kw in [("lenet", dict(in_channels=1, image_size=28)), ("allcnn", dict(in_channels=3, image_size=32)),
                 ("resnet18", dict(in_channels=3, image_size=32))]:
    ts = [t.detach().clone() for t in sync_tensors(build_model(name, num_classes=10, **kw))]
    nbytes = sum(t.numel() * 4 for t in ts)
    buf = np.concatenate([t.numpy().ravel() for t in ts])
    res = np.empty_like(buf)

    def mpi():
        MPI.COMM_WORLD.Allreduce(buf, res, op=MPI.SUM)
        np.divide(res, comm.size(), out=res)

    ways = {"torch_fused": through(torch_eng, lambda: comm.allreduce_mean_(ts)), "mpi4py": mpi}
    if have_hvd:
        ways = {"fused": through(hvd_eng, lambda: comm.allreduce_mean_(ts)),
                "per_tensor": through(hvd_eng, lambda: comm.allreduce_each_(ts)), **ways}
    times = {k: [] for k in ways}
    for label, f in ways.items():      # warm-up: buffers, connections
        f()
    for _ in range(rounds):
        for label, f in ways.items():
            MPI.COMM_WORLD.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                f()
            MPI.COMM_WORLD.Barrier()
            times[label].append((time.perf_counter() - t) / reps)
    r = {"bytes": nbytes, "tensors": len(ts)}
    r.update({k: float(np.median(v)) for k, v in times.items()})
    out[name] = r
if comm.rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
if have_hvd:
    torch_eng.shutdown()
comm.shutdown()
