"""Run on 2 ranks under mpirun by bench/sync_cost.py: seconds per sync of a model's
weights, three ways, the same bytes each time."""
import json
import sys
import time

from mpi4py import MPI          # initialises MPI before Horovod, which then uses it
import numpy as np
import torch

from parle_hvd import comm
from parle_hvd.models import build_model, sync_tensors

comm.init()
torch.set_num_threads(1)
reps = int(sys.argv[1])
out = {}
for name, kw in [("lenet", dict(in_channels=1, image_size=28)), ("allcnn", dict(in_channels=3, image_size=32)),
                 ("resnet18", dict(in_channels=3, image_size=32))]:
    ts = [t.detach().clone() for t in sync_tensors(build_model(name, num_classes=10, **kw))]
    nbytes = sum(t.numel() * 4 for t in ts)
    buf = np.concatenate([t.numpy().ravel() for t in ts])
    res = np.empty_like(buf)

    def fused():
        comm.allreduce_mean_(ts)

    def each():
        comm.allreduce_each_(ts)

    def mpi():
        MPI.COMM_WORLD.Allreduce(buf, res, op=MPI.SUM)
        np.divide(res, comm.size(), out=res)

    r = {"bytes": nbytes, "tensors": len(ts)}
    for label, f in (("fused", fused), ("per_tensor", each), ("mpi4py", mpi)):
        f()
        MPI.COMM_WORLD.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        MPI.COMM_WORLD.Barrier()
        r[label] = (time.perf_counter() - t) / reps
    out[name] = r
if comm.rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
comm.shutdown()
