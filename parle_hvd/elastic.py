r"""Elastic-SGD (Zhang, Choromanska, LeCun 2015), the paper's baseline, as PARLE.md states it.

Each replica, every step::

    g = grad f(x[a]) + wd * x[a] + rk * (x[a] - xbar)
    x[a] = x[a] - lr * g

with ``xbar`` the mean of the replicas, re-formed every ``sync_period`` (tau) steps
(1 by default; between syncs the last reference is used) and ``rk`` scoped exactly like
Parle's elastic coupling. Departure: optional momentum on ``g`` (``optim.momentum``,
Nesterov by default), as in the authors' research code's ElasticSGD; ``optim.momentum=0``
gives PARLE.md's formula exactly.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor


@torch.no_grad()
def elastic_step_(xs: List[Tensor], grads: List[Optional[Tensor]], xbars: List[Tensor], bufs: List[Tensor],
                  *, lr: float, rho_inv: float, weight_decay: float, momentum: float, nesterov: bool) -> None:
    """One Elastic-SGD step, in place on ``xs`` and ``bufs``."""
    for x, gr, xb, v in zip(xs, grads, xbars, bufs):
        g = torch.zeros_like(x) if gr is None else gr.clone()
        if weight_decay != 0.0:
            g.add_(x, alpha=weight_decay)
        if rho_inv != 0.0:
            g.add_(x - xb, alpha=rho_inv)
        if momentum != 0.0:
            v.mul_(momentum).add_(g)
            g = g.add(v, alpha=momentum) if nesterov else v.clone()
        x.add_(g, alpha=-lr)
