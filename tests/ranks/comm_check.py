"""Each rank fills tensors with its rank number; checks the comm module's collectives."""
import torch

from _rank import report
from parle_hvd import comm

comm.init()
r, n = comm.rank(), comm.size()
dtypes = [torch.float32, torch.float64, torch.bfloat16]
shapes = [(3,), (2, 5), (4, 1, 3), ()]
res = {"rank": r, "size": n, "controller": comm.controller(), "engine": comm.engine()}

# 1. fused mean over mixed shapes and dtypes, one call
ts = [torch.full(s, float(r), dtype=d) for d in dtypes for s in shapes]
ts.append(torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1))   # not just constants
before = comm.stats()
comm.allreduce_mean_(ts)
after = comm.stats()
res["mean_values"] = [t.double().flatten().tolist() for t in ts]
res["mean_dtypes"] = [str(t.dtype) for t in ts]
res["mean_shapes"] = [list(t.shape) for t in ts]
res["mean_calls"] = after.allreduce_calls - before.allreduce_calls
res["mean_bytes"] = after.allreduce_bytes - before.allreduce_bytes
# wire dtype is float64 (a float64 tensor is present): 8 bytes per element
res["mean_expected_bytes"] = 8 * sum(t.numel() for t in ts)

# 2. means and sums in one buffer
m = torch.full((5,), float(r)); s = torch.tensor([float(r), 1.0])
comm.fused_allreduce_(means=[m], sums=[s])
res["fused_mean"] = m.tolist(); res["fused_sum"] = s.tolist()

# 2b. the same, asynchronous (parle.overlap's sync): values taken at the start, result at wait()
am = torch.full((4,), float(r)); asum = torch.tensor([float(r) + 1.0], dtype=torch.float64)
pending = comm.fused_allreduce_start(means=[am], sums=[asum], name="async")
am.fill_(100.0); asum.fill_(100.0)          # changed while in flight: must not leak into the result
pending.wait()
res["async_mean"] = am.tolist(); res["async_sum"] = asum.tolist()

# 3. broadcast of tensors (bit exact, mixed dtypes incl. int) and of an object
b = [torch.full((3, 2), 10.0 + r, dtype=torch.float32), torch.tensor([r, -r], dtype=torch.int64),
     torch.full((2,), 0.1 * (r + 1), dtype=torch.float64)]
before = comm.stats()
comm.broadcast_(b, root=0)
after = comm.stats()
res["bcast"] = [t.tolist() for t in b]
res["bcast_calls"] = after.broadcast_calls - before.broadcast_calls
res["bcast_bytes"] = after.broadcast_bytes - before.broadcast_bytes
res["bcast_expected_bytes"] = 6 * 4 + 2 * 8 + 2 * 8
import pickle
payload = {"from": 0, "cfg": {"lr": 0.1}}
res["obj_pickle_bytes"] = len(pickle.dumps(payload))
obj = comm.broadcast_object({"from": r, "cfg": {"lr": 0.1 * (r + 1)}} if r == 0 else None)
res["obj"] = obj
res["stats"] = comm.stats().as_dict()
report(res, r)
comm.shutdown()
