"""What travels in the one sync per outer step, and the schedule rank 0 sends in it.

The sync is ONE fused allreduce carrying, in one flat buffer:
  * the replica's parameters and BatchNorm buffers (averaged: the reference);
  * rank 0's plans for the next two outer steps (gk, rk, lr_k, and every replica's number
    of inner steps; other ranks send 0, so the sum is rank 0's value: a broadcast folded
    into the allreduce);
  * one slot row per replica (only that replica's row is non-zero, so the sum gathers
    every replica's training loss, its distance to the reference, its flags and its speed).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from . import comm
from .parle import lr_at, scoping, scoping_auto

# one row per replica in every sync; "ckpt": this rank could not write its last checkpoint;
# "step_seconds": its seconds per inner step in this outer step's inner loop (parle.balance)
SLOT = ("loss", "loss_max", "distance", "nonfinite", "stop", "hosts", "ckpt", "step_seconds")
SCHED = ("gk", "rk", "lr")                               # rank 0's values for an outer step


class Plan(NamedTuple):
    """Rank 0's plan for one outer step: the couplings, the learning rate, and every
    replica's number of inner steps (``L`` each, unless ``parle.balance=time``)."""
    gk: float
    rk: float
    lr: float
    steps: tuple


class Exchange:
    """Packs what rides along with the reference allreduce (see the module docstring).

    Rank 0 sends the plans of the NEXT TWO outer steps: a blocking sync uses the first, an
    overlapped one (``parle.overlap``, still in flight when the next step begins) the
    second, which the sync before it delivered. The buffer has the model's dtype; every
    plan value is sent as two numbers, ``hi = v`` rounded to that dtype and ``lo = v - hi``,
    so that ``hi + lo`` gives every rank (rank 0 included) the same value, within 1e-14 of
    rank 0's float64 one even in a float32 buffer (step counts are exact)."""

    AHEAD = 2

    def __init__(self, world: int, rank: int, dtype: torch.dtype):
        self.world, self.rank, self.dtype = world, rank, dtype
        self.per_plan = len(SCHED) + world
        self.n_sched = 2 * self.AHEAD * self.per_plan
        self.buf = torch.zeros(self.n_sched + world * len(SLOT), dtype=dtype)

    def pack(self, plans: Optional[Sequence[Plan]], slot: dict) -> torch.Tensor:
        self.buf.zero_()
        m = self.n_sched // 2
        if self.rank == 0:
            v = torch.tensor([x for p in plans for x in (p.gk, p.rk, p.lr, *p.steps)], dtype=torch.float64)
            if v.numel() != m:
                raise ValueError(f"Exchange.pack: {len(plans)} plans of {len(plans[0].steps)} replicas; "
                                 f"want {self.AHEAD} of {self.world}")
            hi = v.to(self.dtype)
            self.buf[:m] = hi
            self.buf[m:2 * m] = (v - hi.double()).to(self.dtype)
        off = self.n_sched + self.rank * len(SLOT)
        self.buf[off:off + len(SLOT)] = torch.tensor([float(slot[k]) for k in SLOT], dtype=torch.float64)
        return self.buf

    def unpack(self) -> tuple[list, torch.Tensor]:
        """``([plan of step k+1, plan of step k+2], every replica's slot row)``."""
        b = self.buf.double()
        m, pp = self.n_sched // 2, self.per_plan
        v = (b[:m] + b[m:2 * m]).tolist()
        plans = [Plan(v[i * pp], v[i * pp + 1], v[i * pp + 2], tuple(int(round(x)) for x in v[i * pp + 3:(i + 1) * pp]))
                 for i in range(self.AHEAD)]
        rows = b[self.n_sched:].view(self.world, len(SLOT))
        return plans, rows


def sync_start(model_t: list, ref_t: list, ex: Exchange, plans: Optional[Sequence[Plan]], slot: dict) -> comm.Pending:
    """Start the sync: one allreduce forms the reference (into ``ref_t``, at ``wait()``) from
    every replica's ``model_t`` (copied now: the replica may go on training) and exchanges
    rank 0's plans and every replica's slot. ``ex.unpack()`` reads them after the wait.
    All ranks reach this, once per outer step."""
    ctrl = ex.pack(plans, slot)
    return comm.fused_allreduce_start(means=model_t, sums=[ctrl], out_means=ref_t, name="sync")   # all ranks reach this


def sync(model_t: list, ref_t: list, ex: Exchange, plans: Optional[Sequence[Plan]], slot: dict):
    """The blocking sync: ``sync_start`` then wait. Returns ``(plans, rows)``. All ranks reach this."""
    sync_start(model_t, ref_t, ex, plans, slot).wait()          # all ranks reach this
    return ex.unpack()


def exchange_slots(slot: dict, rank: int, world: int) -> torch.Tensor:
    """For algorithms without a sync of their own: gather every rank's slot row (loss,
    non-finite and stop flags) in one small float64 allreduce per outer step. At world
    size 1, no collective. All ranks reach this, once per outer step."""
    rows = torch.zeros(world, len(SLOT), dtype=torch.float64)
    rows[rank] = torch.tensor([float(slot[c]) for c in SLOT], dtype=torch.float64)
    comm.allreduce_sum_([rows], name="slots")   # all ranks reach this
    return rows


def replica_distance(xs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """``||x[a] - xbar||`` over the trained tensors (the replica's anchor and the reference's
    parameters): multi-tensor, one device sync."""
    xs, refs = list(xs), list(refs)
    if not xs:
        return 0.0
    with torch.no_grad():
        norms = torch._foreach_norm(torch._foreach_sub(xs, refs))
        return float(torch.linalg.vector_norm(torch.stack(norms).double()))


def outer_schedule(k: int, *, L: int, nb: int, parle, optim, epochs: float) -> tuple:
    """``(gk, rk, lr)`` for outer step ``k`` of ``L`` inner steps, ``nb`` batches per pass.

    One clock for every algorithm, passes over the data: the couplings grow as PARLE.md's
    ``(1 + s/nb)^k`` with ``k`` counted in Parle outer steps of ``parle.sync_period`` inner
    steps, i.e. ``k_scope = k * L / parle.sync_period`` (= k for Parle), so Elastic-SGD
    (L = tau) has the coupling Parle has after the same number of passes. The learning rate
    is read at the middle of the step, ``passes = (k - 1/2) * L / nb``, so a warm-up never
    gives a whole step lr 0 and a milestone applies from the step whose middle passes it.
    ``parle.scoping=auto`` (docs/algorithm.md): the couplings are read at the end of step k,
    ``k*L/nb`` passes, and reach their caps at ``parle.scoping_end * epochs`` passes."""
    if parle.scoping == "auto":      # at its caps after scoping_end of the run's passes (end of step k)
        gk, rk = scoping_auto(k * L / nb, gamma0_inv=parle.gamma0_inv, gamma_min_inv=parle.gamma_min_inv,
                              rho0_inv=parle.rho0_inv, rho_min_inv=parle.rho_min_inv,
                              end_passes=parle.scoping_end * epochs)
    else:
        gk, rk = scoping(k * L / parle.sync_period, gamma0_inv=parle.gamma0_inv, gamma_min_inv=parle.gamma_min_inv,
                         rho0_inv=parle.rho0_inv, rho_min_inv=parle.rho_min_inv, scoping=parle.scoping, nb=nb)
    lr = lr_at((k - 0.5) * L / nb, lr=optim.lr, schedule=optim.schedule, milestones=optim.milestones,
               decay=optim.decay, total_passes=epochs, warmup_passes=optim.warmup_passes)
    return gk, rk, lr
