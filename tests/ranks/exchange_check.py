"""The per-step sync on 2 ranks: one allreduce forms the exact mean of the replicas'
tensors, delivers rank 0's plans (schedule and inner steps) to every rank even though
rank 1 computed different values, and gathers every replica's slot row; started
asynchronously, the replica may change its tensors before the wait without changing the result."""
import torch

from _rank import report
from parle_hvd import comm
from parle_hvd.exchange import Exchange, Plan, sync, sync_start

comm.init()
r, n = comm.rank(), comm.size()
res = {}
for dtype in (torch.float32, torch.float64):
    model_t = [torch.full((3, 2), float(r), dtype=dtype), torch.full((4,), 2.0 * r, dtype=dtype)]
    ref_t = [torch.zeros_like(t) for t in model_t]
    ex = Exchange(n, r, dtype)
    # rank 1 "would" use other values: a different config, clock or step count
    my_plans = ([Plan(0.0123456789, 1.23456789, 0.1, (5, 5)), Plan(0.02, 1.5, 0.01, (3, 7))] if r == 0
                else [Plan(99.0, 98.0, 97.0, (1, 1)), Plan(9.0, 8.0, 7.0, (2, 2))])
    slot = {"loss": 1.5 + r, "loss_max": 2.5 + r, "distance": 10.0 * (r + 1), "nonfinite": 0,
            "stop": float(r == 1), "hosts": 2.0 * (r == 0), "ckpt": float(r == 1), "step_seconds": 0.5 * (r + 1)}
    before = comm.stats().allreduce_calls
    plans, rows = sync(model_t, ref_t, ex, my_plans, slot)
    # started, then the replica trains on before the wait: the sync has what was sent
    ref2 = [torch.zeros_like(t) for t in model_t]
    pending = sync_start(model_t, ref2, ex, my_plans, slot)
    for t in model_t:
        t.add_(100.0)
    pending.wait()
    for t in model_t:
        t.sub_(100.0)
    res[str(dtype)] = {"calls": comm.stats().allreduce_calls - before, "plans": [list(p) for p in plans],
                       "rows": rows.tolist(), "ref": [t.double().flatten().tolist() for t in ref_t],
                       "ref_async": [t.double().flatten().tolist() for t in ref2],
                       "model_untouched": all(bool((t == v).all()) for t, v in zip(model_t, [r, 2.0 * r]))}
report(res, r)
comm.shutdown()
