r"""Parle: the update rule, as pure functions over lists of tensors.

No Horovod, no data, no models: everything here is unit-tested in float64 against a
hand-written loop (tests/test_parle.py). The trainer (parle_hvd/trainer.py) supplies the
reference ``xbar`` from one fused allreduce per outer step, and the scoping values
``gk, rk, lr_k`` from rank 0.

Vocabulary (used the same way in the whole project; docs/algorithm.md explains it):

* **replica** ``a``: one MPI rank's copy of the network, weights ``x[a]``.
* **reference** ``xbar``: the mean of the replicas' weights (and BatchNorm buffers),
  formed by one allreduce. It is the model that is evaluated and shipped.
* **inner step**: one local-entropy SGD step on the inner variable ``y``; no communication.
* **outer step** ``k = 1, 2, ...``: ``sync_period`` (``L``) inner steps, then the update of
  ``x[a]`` with the elastic pull toward the reference; one allreduce per outer step.

The algorithm (Chaudhari et al., "Parle: parallelizing stochastic gradient descent",
arXiv 1707.00424; the project's reading is ../shared/PARLE.md)::

    gk   = min(1/gamma0 * (1 + s/nb)^k, 1/gamma_min)        # inner coupling, 1/gamma
    rk   = min(1/rho0   * (1 + s/nb)^k, 1/rho_min)          # elastic coupling, 1/rho
    xbar = mean_a x[a]
    y = x[a];  z = x[a]
    repeat L times:
        g    = grad f(y; minibatch) + wd * y + gk * (y - x[a])
        v_in = mu * v_in + g;   g = g + mu * v_in            # Nesterov
        y    = y - lr_inner * g
        z    = alpha * z + (1 - alpha) * y
    d     = (x[a] - z) + rk * (x[a] - xbar)
    v_out = mu * v_out + d;  d = d + mu * v_out              # Nesterov
    x[a]  = x[a] - lr_k * d

Defaults: L = 25, alpha = 0.75, mu = 0.9, 1/gamma0 = 0.01, 1/gamma_min = 1, 1/rho0 = 1,
1/rho_min = 10, s = 0.5, nb = mini-batches in one pass over the replica's data,
lr_inner = the initial learning rate held fixed, lr_k = the outer schedule.
Momentum buffers are never reset; y and z restart from x[a] at every outer step.
With ``nesterov=False`` the buffers give heavy-ball momentum (``g = v``).

Departures from the sources (PARLE.md lists them; the code follows PARLE.md):

* The elastic pull is toward the mean of the x's (the paper's equations), not the mean
  of the z's as in the authors' research code (pratikac/distributed-ensembles, 6ac57cb),
  which needs a second collective; here there is one allreduce per outer step.
* Coefficient 1, not 1/gamma, on ``(x[a] - z)`` (as in the research code).
* Unlike ``ucla-vision/parle``'s ``parle_mpi.py``: the outer update is applied to x[a]
  (not y), the inner learning rate is not decayed with the outer one, rho0 is not
  ``0.01 * L * n``, and the scoping counter advances once per outer step (not once per
  parameter tensor).
* Weight decay is applied to every trained tensor (BatchNorm affine parameters too), as
  in both sources; BatchNorm running statistics are not trained, only averaged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "coupling", "scoping", "coupling_auto", "scoping_auto", "lr_at", "balance_steps", "parle_inner_step_", "z_average_",
    "parle_outer_step_", "Parle",
]


# --------------------------------------------------------------------------- schedules
def coupling(k: int, *, start: float, cap: float, scoping: float, nb: int) -> float:
    """Scoped coupling strength at outer step ``k``: ``min(start * (1 + scoping/nb)^k, cap)``.

    ``start``/``cap`` are inverse widths (1/gamma0, 1/gamma_min or 1/rho0, 1/rho_min).
    Computed in log space so that large ``k`` cannot overflow before the cap applies."""
    if start <= 0.0:
        return 0.0 if start == 0.0 else start
    logv = math.log(start) + k * math.log1p(scoping / nb)
    return cap if logv >= math.log(cap) else math.exp(logv)


def scoping(k: int, *, gamma0_inv: float, gamma_min_inv: float, rho0_inv: float,
            rho_min_inv: float, scoping: float, nb: int) -> tuple[float, float]:
    """``(gk, rk)``: the inner and elastic coupling strengths at outer step ``k``."""
    gk = coupling(k, start=gamma0_inv, cap=gamma_min_inv, scoping=scoping, nb=nb)
    rk = coupling(k, start=rho0_inv, cap=rho_min_inv, scoping=scoping, nb=nb)
    return gk, rk


def coupling_auto(passes: float, *, start: float, cap: float, end_passes: float) -> float:
    """``parle.scoping=auto``: geometric growth from ``start`` (at 0 passes) to ``cap`` (at
    ``end_passes``), then held: ``start * (cap/start)^min(passes/end_passes, 1)``. Unlike
    PARLE.md's ``(1 + s/nb)^k`` it reaches the cap within the run whatever its length."""
    if start <= 0.0:
        return 0.0 if start == 0.0 else start
    f = min(max(passes / end_passes, 0.0), 1.0)
    return cap if f >= 1.0 else start * (cap / start) ** f


def scoping_auto(passes: float, *, gamma0_inv: float, gamma_min_inv: float, rho0_inv: float,
                 rho_min_inv: float, end_passes: float) -> tuple[float, float]:
    """``(gk, rk)`` with ``parle.scoping=auto``: each coupling at its cap at ``end_passes``."""
    return (coupling_auto(passes, start=gamma0_inv, cap=gamma_min_inv, end_passes=end_passes),
            coupling_auto(passes, start=rho0_inv, cap=rho_min_inv, end_passes=end_passes))


def lr_at(passes: float, *, lr: float, schedule: str, milestones: Sequence[float] = (),
          decay: float = 0.1, total_passes: float = 1.0, warmup_passes: float = 0.0) -> float:
    """The outer learning rate after ``passes`` passes over the replica's data.

    ``constant``: lr. ``step``: lr * decay^(number of milestones <= passes).
    ``cosine``: lr * (1 + cos(pi * passes / total_passes)) / 2.
    An optional linear warm-up over ``warmup_passes`` multiplies any of them."""
    if schedule == "constant":
        v = lr
    elif schedule == "step":
        v = lr * decay ** sum(1 for m in milestones if passes >= m)
    elif schedule == "cosine":
        v = lr * 0.5 * (1.0 + math.cos(math.pi * min(passes / total_passes, 1.0)))
    else:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    if warmup_passes > 0 and passes < warmup_passes:
        v *= passes / warmup_passes
    return v


def balance_steps(seconds_per_step: Sequence[float], *, total: int) -> list[int]:
    """``parle.balance=time``: each replica's number of inner steps ``L_a`` for an outer
    step, so that all finish their inner loops at about the same time.

    ``L_a`` is proportional to the replica's speed ``1 / seconds_per_step[a]``, rounded by
    largest remainder so that ``sum(L_a) == total`` (``n * L``) exactly, and every ``L_a >= 1``
    (a replica below that share gets 1, taken from the fastest). A replica not yet measured
    (a time <= 0 or not finite) counts at the mean speed of the others, all of them at 1."""
    n = len(seconds_per_step)
    if n == 0 or total < n:
        raise ValueError(f"balance_steps: total={total} must be >= the number of replicas {n} >= 1")
    known = [1.0 / s for s in seconds_per_step if s > 0 and math.isfinite(s)]
    mean = sum(known) / len(known) if known else 1.0
    speed = [1.0 / s if s > 0 and math.isfinite(s) else mean for s in seconds_per_step]
    share = [total * v / sum(speed) for v in speed]
    steps = [max(1, int(math.floor(x))) for x in share]
    # hand out what rounding left over, largest fractional part first; take any excess
    # (from replicas raised to 1) from the replicas with the most steps
    order = sorted(range(n), key=lambda a: (-(share[a] - math.floor(share[a])), a))
    i = 0
    while sum(steps) < total:
        steps[order[i % n]] += 1
        i += 1
    while sum(steps) > total:
        a = max(range(n), key=lambda b: (steps[b], -b))
        steps[a] -= 1
    return steps


# --------------------------------------------------------------------------- the update
def _momentum(g: Tensor, v: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """``v = mu*v + g`` in place; the step direction ``g + mu*v`` (Nesterov) or ``v``.
    One tensor (diloco.py); the update functions below use ``_momentum_foreach_``."""
    if momentum == 0.0:
        return g
    v.mul_(momentum).add_(g)
    return g.add(v, alpha=momentum) if nesterov else v


def _momentum_foreach_(gs: List[Tensor], vs: List[Tensor], momentum: float, nesterov: bool) -> List[Tensor]:
    """``v = mu*v + g`` in place on every ``vs``; returns the step directions: ``g + mu*v``
    (Nesterov, in place on ``gs``, which the caller owns) or ``v`` itself (heavy ball: read,
    never written after, so no copy)."""
    if momentum == 0.0:
        return gs
    torch._foreach_mul_(vs, momentum)
    torch._foreach_add_(vs, gs)
    if not nesterov:
        return vs
    torch._foreach_add_(gs, vs, alpha=momentum)
    return gs


@torch.no_grad()
def parle_inner_step_(ys: List[Tensor], grads: List[Optional[Tensor]], xs: List[Tensor],
                      v_in: List[Tensor], *, lr: float, gamma_inv: float, weight_decay: float,
                      momentum: float, nesterov: bool, noise: float = 0.0,
                      generator: Optional[torch.Generator] = None) -> None:
    """One inner step, in place on ``ys`` and ``v_in``::

        g = grad + wd*y + gk*(y - x);  v = mu*v + g;  g = g + mu*v (Nesterov) or v;  y -= lr*g
        y += sqrt(lr) * noise * N(0, I)        # Entropy-SGD's Langevin noise; off when noise = 0

    Multi-tensor (``torch._foreach_*``, as torch.optim's SGD): one launch per operation for
    all tensors, not one per tensor. A tensor whose grad is None (unused in this forward)
    gets only the decay and coupling terms. The noise is drawn on the generator's device."""
    if not ys:
        return
    g = [torch.zeros_like(y) if gr is None else gr for y, gr in zip(ys, grads)]
    g = torch._foreach_add(g, ys, alpha=weight_decay) if weight_decay != 0.0 else [t.clone() for t in g]
    if gamma_inv != 0.0:
        torch._foreach_add_(g, torch._foreach_sub(ys, xs), alpha=gamma_inv)
    torch._foreach_add_(ys, _momentum_foreach_(g, v_in, momentum, nesterov), alpha=-lr)
    if noise != 0.0:
        dev = generator.device if generator is not None else ys[0].device
        eps = [torch.randn(y.shape, generator=generator, dtype=y.dtype, device=dev).to(y.device) for y in ys]
        torch._foreach_add_(ys, eps, alpha=math.sqrt(lr) * noise)


@torch.no_grad()
def z_average_(zs: List[Tensor], ys: List[Tensor], *, alpha: float) -> None:
    """``z = alpha*z + (1 - alpha)*y``, in place on ``zs``."""
    if zs:
        torch._foreach_mul_(zs, alpha)
        torch._foreach_add_(zs, ys, alpha=1.0 - alpha)


@torch.no_grad()
def parle_outer_step_(xs: List[Tensor], zs: List[Tensor], xbars: List[Tensor],
                      v_out: List[Tensor], *, lr: float, rho_inv: float, momentum: float,
                      nesterov: bool) -> None:
    """The outer step, in place on ``xs`` and ``v_out``::

        d = (x - z) + rk*(x - xbar);  v = mu*v + d;  d = d + mu*v (Nesterov) or v;  x -= lr*d"""
    if not xs:
        return
    d = torch._foreach_sub(xs, zs)
    if rho_inv != 0.0:
        torch._foreach_add_(d, torch._foreach_sub(xs, xbars), alpha=rho_inv)
    torch._foreach_add_(xs, _momentum_foreach_(d, v_out, momentum, nesterov), alpha=-lr)


# --------------------------------------------------------------------------- the class
@dataclass
class ParleHyper:
    inner_lr: float
    sync_period: int = 25
    alpha: float = 0.75
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0
    noise: float = 0.0


class Parle:
    """Gathers one replica's trained tensors and runs the functions above on them.

    The model's parameters hold ``y`` during the inner loop and ``x[a]`` between outer
    steps; this object keeps ``x[a]``, ``z`` and both momentum buffers::

        opt = Parle(model.parameters(), inner_lr=0.1)
        for k in range(1, K + 1):
            opt.begin_outer()                     # y = z = x
            for _ in range(L):
                loss(model(batch)).backward()
                opt.inner_step(gamma_inv=gk)      # y step, then z average
                model.zero_grad()
            opt.outer_step(xbar, rho_inv=rk, lr=lr_k)   # x update; params = x

    ``xbar`` is a list matching ``params`` (the reference's parameters)."""

    def __init__(self, params: Iterable[Tensor], *, inner_lr: float, sync_period: int = 25,
                 alpha: float = 0.75, momentum: float = 0.9, nesterov: bool = True,
                 weight_decay: float = 0.0, noise: float = 0.0,
                 generator: Optional[torch.Generator] = None):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("Parle got an empty parameter list")
        self.hp = ParleHyper(inner_lr, sync_period, alpha, momentum, nesterov, weight_decay, noise)
        self.generator = generator
        self.x = [p.detach().clone() for p in self.params]
        self.z = [p.detach().clone() for p in self.params]
        self.v_in = [torch.zeros_like(p) for p in self.params]
        self.v_out = [torch.zeros_like(p) for p in self.params]
        self.inner_steps_done = 0      # inner steps in the current outer step

    @torch.no_grad()
    def begin_outer(self) -> None:
        """``y = x[a]; z = x[a]`` (the params hold x[a] here)."""
        for p, x, z in zip(self.params, self.x, self.z):
            x.copy_(p)
            z.copy_(p)
        self.inner_steps_done = 0

    def inner_step(self, *, gamma_inv: float) -> None:
        h = self.hp
        ys = [p.data for p in self.params]
        parle_inner_step_(ys, [p.grad for p in self.params], self.x, self.v_in, lr=h.inner_lr,
                          gamma_inv=gamma_inv, weight_decay=h.weight_decay,
                          momentum=h.momentum, nesterov=h.nesterov, noise=h.noise,
                          generator=self.generator)
        z_average_(self.z, ys, alpha=h.alpha)
        self.inner_steps_done += 1

    @torch.no_grad()
    def outer_step(self, xbar: Sequence[Tensor], *, rho_inv: float, lr: float) -> None:
        h = self.hp
        parle_outer_step_(self.x, self.z, list(xbar), self.v_out, lr=lr, rho_inv=rho_inv,
                          momentum=h.momentum, nesterov=h.nesterov)
        for p, x in zip(self.params, self.x):
            p.copy_(x)

    def state_dict(self) -> dict:
        """What a resume needs between outer steps: the two momentum buffers (live tensors;
        the caller copies). ``x[a]`` is the model's parameters then, and ``z`` restarts from it
        at the next outer step, so neither is saved."""
        return {"v_in": self.v_in, "v_out": self.v_out, "hp": vars(self.hp).copy()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Load the momentum buffers (after the model's weights: ``x = z = params``)."""
        for name in ("v_in", "v_out"):
            src = sd[name]
            dst = getattr(self, name)
            if len(src) != len(dst) or any(a.shape != b.shape for a, b in zip(src, dst)):
                raise ValueError(f"Parle state {name!r} does not match this model's parameters")
            for d, s in zip(dst, src):
                d.copy_(s)
        for p, x, z in zip(self.params, self.x, self.z):
            x.copy_(p)
            z.copy_(p)
