"""What travels in the one sync per outer step, and the schedule rank 0 sends in it.

The sync is ONE fused allreduce carrying, in one flat buffer:
  * the replica's parameters and BatchNorm buffers (averaged: the reference);
  * rank 0's schedule values for the next outer step (gk, rk, lr_k; other ranks send 0,
    so the sum is rank 0's value: a broadcast folded into the allreduce);
  * one slot row per replica (only that replica's row is non-zero, so the sum gathers
    every replica's training loss, its distance to the reference and its flags).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import comm
from .parle import lr_at, scoping, scoping_auto

# one row per replica in every sync; "ckpt": this rank could not write its last checkpoint
SLOT = ("loss", "loss_max", "distance", "nonfinite", "stop", "hosts", "ckpt")
SCHED = ("gk", "rk", "lr")                               # rank 0's values for the next step



class Exchange:
    """Packs what rides along with the reference allreduce (see the module docstring).

    The buffer has the model's dtype. Rank 0's schedule values are sent as two numbers
    each, ``hi = v`` rounded to that dtype and ``lo = v - hi``, so that ``hi + lo`` gives
    every rank (rank 0 included) the same value, within 1e-14 of rank 0's float64 one
    even in a float32 buffer."""

    def __init__(self, world: int, rank: int, dtype: torch.dtype):
        self.world, self.rank, self.dtype = world, rank, dtype
        self.n_sched = 2 * len(SCHED)
        self.buf = torch.zeros(self.n_sched + world * len(SLOT), dtype=dtype)

    def pack(self, sched: Optional[tuple], slot: dict) -> torch.Tensor:
        self.buf.zero_()
        if self.rank == 0:
            v = torch.tensor(sched, dtype=torch.float64)
            hi = v.to(self.dtype)
            self.buf[:len(SCHED)] = hi
            self.buf[len(SCHED):self.n_sched] = (v - hi.double()).to(self.dtype)
        off = self.n_sched + self.rank * len(SLOT)
        self.buf[off:off + len(SLOT)] = torch.tensor([float(slot[k]) for k in SLOT], dtype=torch.float64)
        return self.buf

    def unpack(self) -> tuple[tuple, torch.Tensor]:
        b = self.buf.double()
        sched = tuple(float(h + l) for h, l in zip(b[:len(SCHED)], b[len(SCHED):self.n_sched]))
        rows = b[self.n_sched:].view(self.world, len(SLOT))
        return sched, rows


def sync(model_t: list, ref_t: list, ex: Exchange, sched: Optional[tuple], slot: dict):
    """Form the reference in ``ref_t`` from every replica's ``model_t`` and exchange the
    schedule and the slots: one allreduce. All ranks reach this, once per outer step."""
    with torch.no_grad():
        for r, m in zip(ref_t, model_t):
            r.copy_(m)
    ctrl = ex.pack(sched, slot)
    comm.fused_allreduce_(means=ref_t, sums=[ctrl], name="sync")   # all ranks reach this
    return ex.unpack()


def exchange_slots(slot: dict, rank: int, world: int) -> torch.Tensor:
    """For algorithms without a sync of their own: gather every rank's slot row (loss,
    non-finite and stop flags) in one small float64 allreduce per outer step. At world
    size 1, no collective. All ranks reach this, once per outer step."""
    rows = torch.zeros(world, len(SLOT), dtype=torch.float64)
    rows[rank] = torch.tensor([float(slot[c]) for c in SLOT], dtype=torch.float64)
    comm.allreduce_sum_([rows], name="slots")   # all ranks reach this
    return rows


def replica_distance(model: nn.Module, ref: nn.Module) -> float:
    with torch.no_grad():
        s = sum(float((p.double() - q.double()).pow(2).sum()) for p, q in zip(model.parameters(), ref.parameters()))
    return math.sqrt(s)


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
