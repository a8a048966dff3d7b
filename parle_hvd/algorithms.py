"""The algorithms the trainer can run (``algo=`` in the config), behind one small
interface. The math lives in parle.py, easgd.py (Elastic-SGD) and diloco.py (pure functions, tested
in float64); plain SGD steps use torch.optim.SGD; data-parallel SGD uses Horovod's
DistributedOptimizer or torch's DistributedDataParallel (comm.data_parallel). docs/algorithms.md describes each one.

The trainer drives every algorithm the same way::

    for each outer step:
        algo.begin_outer()
        L times: forward (algo.module), backward, algo.inner_step(gk=, rk=, lr=, xbar=)
        algo.end_outer(xbar, rk=, lr=)
        if algo.syncs: one fused allreduce forms the reference; algo.after_sync(model_t, ref_t)
                       (with parle.overlap, for algorithms that ``overlaps``: started here and
                       waited for just before the next end_outer)
    before an evaluation: algo.form_reference(model_t, ref_t)   (algorithms without syncs)
"""
from __future__ import annotations

import contextlib
import math
from typing import List

import torch
from torch import nn

from . import comm
from .diloco import diloco_outer_step_
from .data import _gen
from .easgd import elastic_step_
from .parle import Parle


class Algorithm:
    name = ""
    syncs = True             # one fused allreduce (reference + schedule + slots) per outer step
    same_init = False        # replicas must start from rank 0's weights
    shard_data = False       # each rank a disjoint shard (data-parallel), not its own replica's data
    couplings = ()           # which of gamma/rho the algorithm uses (for logging)
    ref_is_mean = False      # the reference is the replicas' mean (elastic mode re-forms it when one is lost)
    overlaps = False         # the inner loop does not read the reference (parle.overlap, parle.balance apply)

    def __init__(self, model: nn.Module, cfg, world: int, rank: int):
        self.model, self.cfg, self.world, self.rank = model, cfg, world, rank
        self.params: List[torch.Tensor] = list(model.parameters())
        self.module: nn.Module = model     # what the inner loop calls forward on (dpsgd: DDP's wrapper)
        self.L = 1

    def begin_outer(self) -> None:
        pass

    def inner_step(self, *, gk: float, rk: float, lr: float, xbar) -> None:
        raise NotImplementedError

    def end_outer(self, xbar, *, rk: float, lr: float) -> None:
        pass

    def skip_step(self) -> None:
        """An inner step whose gradients overflowed (fp16): nothing is updated."""

    def sync_grads(self) -> None:
        """Gradients averaged across ranks (dpsgd), now."""

    def no_sync(self):
        """A context in which backward does not average gradients (accumulation)."""
        return contextlib.nullcontext()

    def after_sync(self, model_t: list, ref_t: list) -> None:
        pass

    def anchor(self) -> list:
        """The replica's weights x[a] as last sent to the sync (for ``||x[a] - xbar||``)."""
        return self.params

    def form_reference(self, model_t: list, ref_t: list) -> None:
        """Algorithms without syncs: make ``ref_t`` the model to evaluate. All ranks reach this."""

    def shared_tensors(self) -> list:
        """State that is the same on every replica besides the reference (elastic mode
        sends it to a replica that joins)."""
        return []

    def state_dict(self) -> dict:
        """What a resume needs beyond the model's weights, as live tensors (the caller copies)."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _copy_(dst: list, src: list) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


def _sgd(params, cfg, lr=None):
    O = cfg.optim
    return torch.optim.SGD(params, lr=lr or O.lr, momentum=O.momentum, nesterov=O.nesterov and O.momentum > 0,
                           weight_decay=O.weight_decay)


def _set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


class ParleAlgo(Algorithm):
    """Parle (parle.py): L local-entropy inner steps, then the outer step with the elastic pull."""
    name = "parle"
    couplings = ("gamma", "rho")
    ref_is_mean = True
    overlaps = True

    def __init__(self, model, cfg, world, rank):
        super().__init__(model, cfg, world, rank)
        P, O = cfg.parle, cfg.optim
        self.L = P.sync_period
        self.opt = Parle(self.params, inner_lr=O.lr, sync_period=P.sync_period, alpha=P.alpha, momentum=O.momentum,
                         nesterov=O.nesterov, weight_decay=O.weight_decay, **self._noise())
        self.in_outer = False      # between begin_outer and end_outer (the params then hold y)

    def _noise(self) -> dict:
        return {}

    def begin_outer(self):
        self.opt.begin_outer()
        self.in_outer = True

    def inner_step(self, *, gk, rk, lr, xbar):
        self.opt.inner_step(gamma_inv=gk)

    def end_outer(self, xbar, *, rk, lr):
        self.opt.outer_step(xbar, rho_inv=rk, lr=lr)
        self.in_outer = False

    def anchor(self):
        # inside an outer step the params hold y and x[a] is kept aside; between outer steps
        # the params are x[a] (also after a resume, or a joiner's copy of the reference)
        return self.opt.x if self.in_outer else self.params

    def state_dict(self):
        return {"parle": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["parle"])


class EntropyAlgo(ParleAlgo):
    """Entropy-SGD: Parle on one replica (no elastic term, no sync), with optional Langevin
    noise. With several ranks, each runs its own independent replica (seed + rank); the
    evaluated and saved model is rank 0's."""
    name = "entropy"
    syncs = False
    overlaps = False         # no sync to overlap; and balance would change rank 0's (the evaluated) replica
    couplings = ("gamma",)

    def _noise(self):
        self.gen = _gen("langevin", self.cfg.train.seed, self.rank, device=self.params[0].device)   # drawn on the device
        return {"noise": self.cfg.entropy.noise, "generator": self.gen}

    def end_outer(self, xbar, *, rk, lr):
        self.opt.outer_step(self.opt.x, rho_inv=0.0, lr=lr)     # n = 1: xbar = x

    def form_reference(self, model_t, ref_t):
        _copy_(ref_t, model_t)
        comm.broadcast_(ref_t, root=0, name="ref")             # all ranks reach this

    def state_dict(self):
        return {**super().state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.gen.set_state(sd["gen"])


class ElasticSGDAlgo(Algorithm):
    """Elastic-SGD (easgd.py), PARLE.md's form: every step
    x -= lr*(grad + wd x + rk (x - xbar)), the reference re-formed every elastic.sync_period
    steps. No momentum unless elastic.momentum > 0 (then Nesterov or heavy ball as optim.nesterov)."""
    name = "elastic"
    couplings = ("rho",)
    ref_is_mean = True

    def __init__(self, model, cfg, world, rank):
        super().__init__(model, cfg, world, rank)
        self.L = cfg.elastic.sync_period
        self.bufs = [torch.zeros_like(p) for p in self.params] if cfg.elastic.momentum > 0 else []

    def inner_step(self, *, gk, rk, lr, xbar):
        O, E = self.cfg.optim, self.cfg.elastic
        bufs = self.bufs or [None] * len(self.params)
        elastic_step_([p.data for p in self.params], [p.grad for p in self.params], list(xbar), bufs,
                      lr=lr, rho_inv=rk, weight_decay=O.weight_decay, momentum=E.momentum, nesterov=O.nesterov)

    def state_dict(self):
        return {"bufs": self.bufs}

    def load_state_dict(self, sd):
        _copy_(self.bufs, sd["bufs"])


class LocalSGDAlgo(Algorithm):
    """Local SGD: each replica takes localsgd.sync_period SGD steps on its own, then every
    replica is replaced by the replicas' mean (weights and BatchNorm statistics). Momentum
    buffers stay local. Replicas start from rank 0's weights."""
    name = "localsgd"
    same_init = True

    def __init__(self, model, cfg, world, rank):
        super().__init__(model, cfg, world, rank)
        self.L = cfg.localsgd.sync_period
        self.opt = _sgd(self.params, cfg)

    def inner_step(self, *, gk, rk, lr, xbar):
        _set_lr(self.opt, lr)
        self.opt.step()

    def after_sync(self, model_t, ref_t):
        _copy_(model_t, ref_t)

    def state_dict(self):
        return {"opt": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])


class DiLoCoAlgo(Algorithm):
    """DiLoCo (diloco.py): diloco.sync_period inner optimizer steps (SGD-Nesterov or AdamW)
    from the global weights, then the averaged pseudo-gradient applied by outer Nesterov
    SGD; every replica restarts from the new global weights, which are the reference."""
    name = "diloco"
    same_init = True

    def __init__(self, model, cfg, world, rank):
        super().__init__(model, cfg, world, rank)
        D = cfg.diloco
        self.L = D.sync_period
        self.base_lr = D.inner_lr or cfg.optim.lr
        if D.inner == "adamw":
            self.opt = torch.optim.AdamW(self.params, lr=self.base_lr, weight_decay=cfg.optim.weight_decay)
        else:
            self.opt = _sgd(self.params, cfg, lr=self.base_lr)
        self.theta = [p.detach().clone() for p in self.params]
        self.bufs = [torch.zeros_like(p) for p in self.params]

    def inner_step(self, *, gk, rk, lr, xbar):
        # the inner lr follows the outer schedule's shape: base * lr_k / optim.lr
        _set_lr(self.opt, self.base_lr * lr / self.cfg.optim.lr)
        self.opt.step()

    def after_sync(self, model_t, ref_t):
        n = len(self.params)
        D = self.cfg.diloco
        diloco_outer_step_(self.theta, [t.detach() for t in ref_t[:n]], self.bufs, lr=D.outer_lr,
                           momentum=D.outer_momentum, nesterov=True)
        _copy_(ref_t[:n], self.theta)          # the reference is the global model
        _copy_(model_t, ref_t)                 # every replica restarts from it (BN stats averaged)

    def shared_tensors(self):
        return self.theta + self.bufs          # the global model and its outer momentum

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "theta": self.theta, "bufs": self.bufs}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])
        _copy_(self.theta, sd["theta"])
        _copy_(self.bufs, sd["bufs"])


class SGDAlgo(Algorithm):
    """Plain SGD with Nesterov momentum (the compute reference). With several ranks each
    runs its own independent replica; the evaluated and saved model is rank 0's."""
    name = "sgd"
    syncs = False

    def __init__(self, model, cfg, world, rank):
        super().__init__(model, cfg, world, rank)
        self.L = cfg.train.block
        self.opt = _sgd(self.params, cfg)

    def inner_step(self, *, gk, rk, lr, xbar):
        _set_lr(self.opt, lr)
        self.opt.step()

    def form_reference(self, model_t, ref_t):
        _copy_(ref_t, model_t)
        comm.broadcast_(ref_t, root=0, name="ref")             # all ranks reach this

    def state_dict(self):
        return {"opt": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])


class DPSGDAlgo(SGDAlgo):
    """Data-parallel SGD: one model (rank 0's initial state broadcast), each rank a
    disjoint shard of the data, gradients averaged every step by Horovod's
    DistributedOptimizer or by torch's DistributedDataParallel, by dist.engine (optional
    fp16 compression). dpsgd.lr_scale scales the lr with the world size."""
    name = "dpsgd"
    same_init = True
    shard_data = True

    def __init__(self, model, cfg, world, rank):
        Algorithm.__init__(self, model, cfg, world, rank)
        self.L = cfg.train.block
        self.scale = {"none": 1.0, "linear": float(world), "sqrt": math.sqrt(world)}[cfg.dpsgd.lr_scale]
        self.module, self.opt = comm.data_parallel(model, _sgd(self.params, cfg), fp16=cfg.dpsgd.fp16,
                                                   bucket_mb=cfg.dpsgd.bucket_mb, accum=cfg.train.accum)
        self.synced = False            # this step's gradients already averaged (sync_grads)

    def sync_grads(self):
        if hasattr(self.opt, "skip_synchronize") and not self.synced:     # Horovod's DistributedOptimizer
            self.opt.synchronize()                             # all ranks reach this, every step
            self.synced = True

    def no_sync(self):
        return self.module.no_sync() if hasattr(self.module, "no_sync") else contextlib.nullcontext()

    def inner_step(self, *, gk, rk, lr, xbar):
        _set_lr(self.opt, lr * self.scale)
        if self.synced:
            with self.opt.skip_synchronize():
                self.opt.step()
        else:
            self.opt.step()                                    # all ranks reach this, every step
        self.synced = False

    def skip_step(self):
        self.sync_grads()              # the allreduce is made and counted even when its result is dropped
        self.synced = False

    def form_reference(self, model_t, ref_t):
        # The weights are identical on every rank and are copied as they are (an average
        # would round them: (w+w+w)/3 != w in float32); BatchNorm statistics are not: average
        # only those. No buffers (LeNet): no collective, on every rank alike.
        _copy_(ref_t, model_t)
        buffers = ref_t[len(self.params):]
        if buffers:
            comm.allreduce_mean_(buffers, name="ref.bn")          # all ranks reach this


ALGORITHMS = {a.name: a for a in (ParleAlgo, SGDAlgo, DPSGDAlgo, ElasticSGDAlgo, EntropyAlgo, LocalSGDAlgo, DiLoCoAlgo)}


def make_algorithm(name: str, model: nn.Module, cfg, world: int, rank: int) -> Algorithm:
    return ALGORITHMS[name](model, cfg, world, rank)
