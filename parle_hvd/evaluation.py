"""Evaluating the reference: BatchNorm statistics re-estimated, then test (and
validation) loss and accuracy, sharded across ranks and summed in one allreduce."""
from __future__ import annotations

import torch
from torch import nn

from . import comm
from .data import _gen, to_input
from .stream import eval_batches, train_examples


def _plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)

@torch.no_grad()
def recompute_bn(ref: nn.Module, ds, batches: int, batch_size: int, seed: int, step: int, dtype,
                 dev: torch.device, *, forward=_plain) -> None:
    """Re-estimate the reference's BatchNorm statistics on ``batches`` training batches.
    Every rank uses the same batches (a shuffle seeded by seed and step), so the ranks'
    references stay identical without a collective. ``forward(module, x)`` runs the model
    (the trainer's adds autocast and channels_last)."""
    bns = [m for m in ref.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns or batches == 0:
        return
    saved = [(m, m.momentum) for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None            # cumulative average over the batches
    ref.train()
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.eval()                 # no dropout, and no draw from the training RNG
    perm = torch.randperm(ds.n_train, generator=_gen("bn", seed, step))
    idx = [perm[i * batch_size:(i + 1) * batch_size] for i in range(min(batches, len(perm) // batch_size or 1))]
    for x, _ in train_examples(ds, idx):       # in memory, or decoded (the evaluation transform)
        forward(ref, to_input(x.to(dev), ds.mean, ds.std, dtype))
    for m, mom in saved:
        m.momentum = mom
    ref.eval()


@torch.no_grad()
def _shard_sums(ref: nn.Module, which: str, n: int, ds, rank: int, world: int, batch_size: int, dtype, dev,
                obj, forward=_plain) -> list:
    """[metric sum, summed loss, count] of the reference on this rank's shard of the test
    or validation split (``n`` examples); ``obj`` (targets.Objective) scores a batch."""
    lo, hi = (rank * n) // world, ((rank + 1) * n) // world
    tot = [0.0, 0.0, 0.0]
    for x, y in eval_batches(ds, which, lo, hi, batch_size):
        out = forward(ref, to_input(x.to(dev), ds.mean, ds.std, dtype))
        tot = [a + b for a, b in zip(tot, obj.sums(out, y.to(dev)))]
    return tot


@torch.no_grad()
def evaluate(ref: nn.Module, ds, rank: int, world: int, batch_size: int, dtype, dev: torch.device, extra: list,
             obj=None, *, forward=_plain):
    """Test metric and loss of the reference (and, with a validation split, its validation
    metric and loss), each set sharded across ranks and the sums allreduced in float64
    together with ``extra`` slot rows: one allreduce. All ranks reach this. ``obj``
    (targets.Objective; default cross-entropy and accuracy) scores a batch;
    ``forward(module, x)`` runs the model, and returns outputs in the scoring dtype.
    Returns (test metric, test loss, rows, (valid metric, valid loss) or None)."""
    if obj is None:
        from .targets import objective
        obj = objective()
    ref.eval()
    n_test, n_val = (len(ds.test), None if ds.val is None else len(ds.val)) if ds.streamed else \
        (len(ds.test_x), None if ds.val_x is None else len(ds.val_x))
    parts = _shard_sums(ref, "test", n_test, ds, rank, world, batch_size, dtype, dev, obj, forward)
    if n_val is not None:
        parts += _shard_sums(ref, "val", n_val, ds, rank, world, batch_size, dtype, dev, obj, forward)
    sums = torch.tensor(parts, dtype=torch.float64)
    rows = torch.zeros(world, len(extra), dtype=torch.float64)
    rows[rank] = torch.tensor(extra, dtype=torch.float64)
    comm.allreduce_sum_([sums, rows], name="eval")   # all ranks reach this
    v = sums.tolist()
    valid = (obj.finish(v[3], v[5]), v[4] / v[5]) if len(v) > 3 else None
    return obj.finish(v[0], v[2]), v[1] / v[2], rows, valid
