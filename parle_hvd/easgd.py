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

from torch import Tensor

from .parle import parle_inner_step_


def elastic_step_(xs: List[Tensor], grads: List[Optional[Tensor]], xbars: List[Tensor], bufs: List[Tensor],
                  *, lr: float, rho_inv: float, weight_decay: float, momentum: float, nesterov: bool) -> None:
    """One Elastic-SGD step, in place on ``xs`` and ``bufs``.

    It has the shape of Parle's inner step with the replica in place of y, the reference
    in place of the anchor x[a], and rk in place of gk, so it is computed by that function."""
    parle_inner_step_(xs, grads, xbars, bufs, lr=lr, gamma_inv=rho_inv, weight_decay=weight_decay,
                      momentum=momentum, nesterov=nesterov)
