r"""DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105).

Every replica starts a round from the global weights ``theta``, takes ``sync_period`` (H)
inner optimizer steps (SGD-Nesterov or AdamW; its state stays on the replica across
rounds), then::

    delta = mean_a (theta - x[a])             # the averaged pseudo-gradient (one allreduce of x[a])
    v     = mu * v + delta                     # outer Nesterov SGD, mu = 0.9
    theta = theta - lr_out * (delta + mu * v)  # lr_out = 0.7
    x[a]  = theta

``mean_a (theta - x[a]) = theta - mean_a x[a]``, so the allreduce carries the replicas'
weights (the same bytes as the pseudo-gradients) and the trainer's one sync per outer
step serves DiLoCo unchanged. BatchNorm running statistics are averaged, not stepped.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from .parle import _momentum


@torch.no_grad()
def diloco_outer_step_(thetas: List[Tensor], means: List[Tensor], bufs: List[Tensor], *, lr: float,
                       momentum: float, nesterov: bool = True) -> None:
    """In place on ``thetas`` and ``bufs``; ``means`` holds ``mean_a x[a]``."""
    for th, m, v in zip(thetas, means, bufs):
        th.add_(_momentum(th - m, v, momentum, nesterov), alpha=-lr)
