"""The per-step sync on 2 ranks: one allreduce forms the exact mean of the replicas'
tensors, delivers rank 0's schedule to every rank even though rank 1 computed different
values, and gathers every replica's slot row."""
import torch

from _rank import report
from parle_hvd import comm
from parle_hvd.exchange import Exchange, sync

comm.init()
r, n = comm.rank(), comm.size()
res = {}
for dtype in (torch.float32, torch.float64):
    model_t = [torch.full((3, 2), float(r), dtype=dtype), torch.full((4,), 2.0 * r, dtype=dtype)]
    ref_t = [torch.zeros_like(t) for t in model_t]
    ex = Exchange(n, r, dtype)
    # rank 1 "would" use other values: a different config, clock or step count
    my_sched = (0.0123456789, 1.23456789, 0.1) if r == 0 else (99.0, 98.0, 97.0)
    before = comm.stats().allreduce_calls
    sched, rows = sync(model_t, ref_t, ex, my_sched,
                       {"loss": 1.5 + r, "loss_max": 2.5 + r, "distance": 10.0 * (r + 1), "nonfinite": 0,
                        "stop": float(r == 1), "hosts": 2.0 * (r == 0), "ckpt": float(r == 1)})
    res[str(dtype)] = {"calls": comm.stats().allreduce_calls - before, "sched": list(sched),
                       "rows": rows.tolist(), "ref": [t.double().flatten().tolist() for t in ref_t],
                       "model_untouched": all(bool((t == v).all()) for t, v in zip(model_t, [r, 2.0 * r]))}
report(res, r)
comm.shutdown()
