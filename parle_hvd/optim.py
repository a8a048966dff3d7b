r"""Every algorithm as one ``torch.optim.Optimizer`` that a training script drops in.

    import parle_hvd
    parle_hvd.init()                       # Horovod or torch.distributed, whichever launched us
    opt = parle_hvd.optim.make("parle", model, lr=0.1, sync_period=25, batches_per_pass=len(loader))
    for x, y in loader:
        opt.zero_grad()
        loss_fn(opt.module(x), y).backward()
        opt.step()                         # every L-th call: the outer update and the one fused allreduce
    with opt.reference():                  # the reference's weights in ``model``, then restored
        evaluate(model)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)

One rank is one replica. ``step()`` is one inner step; the call that completes an outer step
(``L`` inner steps, or this replica's share of ``n * L`` with ``balance="time"``) runs the
algorithm's outer update and starts that step's sync: ONE allreduce of one flat buffer that
forms the reference (the mean of the replicas' weights and BatchNorm buffers), carries rank
0's plans for the next two outer steps (the couplings ``gk = 1/gamma``, ``rk = 1/rho``, the
learning rate, every replica's number of inner steps) and one slot row per replica (its
training loss, its distance to the reference, a non-finite flag, its speed, and flags its
trainer adds). Algorithms without a reference (sgd, dpsgd, entropy) exchange the slot rows
in one small allreduce per outer step instead (none at world size 1). Every rank calls
``step()`` the same number of times per outer step (``next_plan().steps[rank]``), or the
job hangs in the sync.

What ``step()`` does for each algorithm (the math: parle.py, easgd.py, diloco.py, and
docs/algorithms.md):

* ``parle``: the local-entropy inner step on ``y`` with the pull ``gk (y - x[a])``, the z
  average; at the outer step ``x[a] -= lr (x[a] - z + rk (x[a] - xbar))`` (Nesterov). The
  group's ``lr`` is PARLE.md's outer ``lr_k`` (the one a schedule moves); the inner learning
  rate is held at the initial one (``inner_lr``, PARLE.md).
* ``entropy``: Parle on one replica (no elastic term, no sync; ``noise`` adds Langevin noise).
* ``elastic``: Elastic-SGD, ``x -= lr (grad + wd x + rk (x - xbar))`` every step.
* ``localsgd``: SGD steps; at the outer step every replica becomes the replicas' mean.
* ``diloco``: inner SGD-Nesterov or AdamW steps; at the outer step the averaged
  pseudo-gradient is applied by outer Nesterov SGD and every replica restarts from it.
* ``sgd``: plain SGD (independent replicas; the reference is rank 0's replica).
* ``dpsgd``: data-parallel SGD; gradients averaged every step (Horovod's
  DistributedOptimizer, or DDP under torch.distributed: call forward through ``opt.module``).

With ``overlap=True`` (parle) the sync of outer step k travels while step k+1's inner steps
run, and is waited for just before step k+1's outer update (its first use of the
reference); ``synchronize()``, ``reference()`` and ``state_dict()`` wait for it at once.

Departures from torch.optim's conventions (docs/api.md): one parameter group (the model's
parameters; Parle's state is a function of the whole replica); ``lr`` in that group is the
rate the algorithm's schedule moves (above), read at every inner step, and written at the
start of an outer step when the trainer's ``schedule`` gives one; ``state_dict()`` holds the
reference and the sync's state too, so that with the model's own ``state_dict`` a resume is
exact, at any inner step.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from . import comm
from .algorithms import ALGORITHMS
from .config import Config, ConfigError, _build
from .exchange import SLOT, Exchange, Plan, exchange_slots, replica_distance, sync, sync_start
from .models import sync_tensors
from .parle import balance_steps, scoping

__all__ = ["make", "DistributedOptimizer", "SyncReport", "NonFiniteError", "InnerTimer", "ALGOS"]

ALGOS = tuple(ALGORITHMS)


class NonFiniteError(RuntimeError):
    """A replica's loss or weights became non-finite; raised on every rank after the same sync."""


class SyncReport(NamedTuple):
    """What one sync told every rank (alike on every rank): outer step ``step`` and its
    ``plan``, every replica's slot row (``rows[a, SLOT.index(name)]``), the step's seconds
    on this rank, and whether the sync was overlapped with the next step's inner steps."""
    step: int
    plan: Plan
    rows: torch.Tensor
    seconds: float
    overlapped: bool


class _InFlight(NamedTuple):
    step: int
    plan: Plan
    t_start: float
    t_sent: float
    pending: Optional[comm.Pending]
    rows: Optional[torch.Tensor]


class InnerTimer:
    """Seconds of one replica's inner steps, for ``balance``. On the CPU, host time. On a
    GPU, CUDA events recorded on the stream the steps run on, and a wait for that stream's
    work alone: with ``overlap`` the previous sync's allreduce is queued on the device too
    (NCCL's stream), held there until the slowest rank joins, and a device-wide
    ``torch.cuda.synchronize`` would add the slow replica's pace to the fast one's time,
    freezing the split short of the right one."""

    def __init__(self, dev: torch.device):
        self.dev, self.t0 = dev, time.monotonic()
        self.start = None
        if dev.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def seconds(self, wait=None) -> float:
        """The seconds since construction; ``wait`` (a context manager, the watchdog's) guards
        the wait for the stream, so that a device held up by a dead peer is named."""
        with wait if wait is not None else contextlib.nullcontext():
            if self.start is None:
                return time.monotonic() - self.t0
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()                  # this stream's work only, never the collective's
        return self.start.elapsed_time(end) / 1000.0


def _injected(hook: str, rank: int, step: int) -> bool:
    """Testing hooks (tests/test_robustness.py), "<rank>:<outer step>"."""
    return os.environ.get(hook, "") == f"{rank}:{step}"


def _fake_step_seconds(rank: int) -> Optional[float]:
    """Testing hook (tests/test_overlap.py): PARLE_HVD_FAKE_STEP_SECONDS="s0,s1,..." reports
    rank r's seconds per inner step as s_r, so that balance's assignments are deterministic."""
    v = os.environ.get("PARLE_HVD_FAKE_STEP_SECONDS")
    return float(v.split(",")[rank]) if v else None


class DistributedOptimizer(torch.optim.Optimizer):
    """One replica's optimizer for any of ``ALGOS``, with the reference and the sync.

    Build it with ``make`` (keyword hyper-parameters) or from a whole ``Config`` (what
    ``train.py`` does). ``model`` is the replica; its parameters are the one group.

    ``schedule(k) -> (gk, rk, lr)`` gives outer step k's couplings and learning rate; rank 0
    evaluates it and sends it in the sync, so every rank uses rank 0's values. ``lr`` may be
    ``nan``: then the group's ``lr`` is used as it stands (a torch LR scheduler drives it).
    ``flags(k) -> dict`` adds a trainer's flags (``stop``, ``ckpt``, ``hosts``) to this
    replica's slot row of outer step k. ``watchdog`` (watchdog.py) names a silent rank
    instead of letting a collective hang. ``init_broadcast=False`` skips the broadcast of
    rank 0's weights that algorithms starting from one model make at construction (a
    resumed run loads them instead).

    Mixed precision: under ``torch.amp.GradScaler`` call ``scaler.step(opt, loss=loss)``.
    This optimizer takes the scaler's ``grad_scale`` and ``found_inf`` (torch's
    ``_step_supports_amp_scaling`` contract), so its ``step()`` runs on every call: a step
    whose gradients overflowed updates nothing but still counts as an inner step
    (``skipped_steps``), and every rank still reaches the sync at the same call. The
    weights, Parle's state, the reference and the sync stay in the model's dtype (fp32
    master state); only the forward and backward run under autocast. With dpsgd call
    ``synchronize_gradients()`` before ``scaler.step`` (Horovod's AMP recipe: the overflow
    check must see the averaged gradients, alike on every rank). Gradient accumulation:
    the micro-batches' backward passes but the last inside ``no_sync()``, ``accum`` of them
    per ``step()``."""

    _step_supports_amp_scaling = True       # GradScaler.step calls step() always, with grad_scale and found_inf

    def __init__(self, model: nn.Module, cfg: Config, *, schedule: Callable[[int], tuple],
                 flags: Optional[Callable[[int], dict]] = None, watchdog=None, init_broadcast: bool = True):
        if not comm.init_called() and comm.launched():     # n processes would each train alone
            raise RuntimeError("parle_hvd.optim: a launcher started this process; call parle_hvd.init() "
                               "first, on every rank")
        params = list(model.parameters())
        if not params:
            raise ValueError("parle_hvd.optim: the model has no parameters")
        self.cfg, self.model, self.schedule, self.flags = cfg, model, schedule, flags
        self.rank, self.world = comm.rank(), comm.size()
        self._guard = watchdog.collective if watchdog is not None else (lambda what, k: contextlib.nullcontext())
        cls = ALGORITHMS[cfg.algo]
        if init_broadcast and (cfg.parle.init == "broadcast" or cls.same_init):
            with self._guard("initial broadcast", 0):
                comm.broadcast_(list(model.state_dict().values()), name="init")   # all ranks reach this
        self.ref_model = copy.deepcopy(model)
        self.algo = cls(model, cfg, self.world, self.rank)
        self.L = self.algo.L
        self.model_t, self.ref_t = sync_tensors(model), sync_tensors(self.ref_model)
        self.ref_params = list(self.ref_model.parameters())
        self.ex = Exchange(self.world, self.rank, params[0].dtype)
        self.dev = params[0].device
        # overlap and balance are Parle's: its inner steps do not read the reference
        self.overlap = cfg.parle.overlap and cls.overlaps
        self.balance = cfg.parle.balance == "time" and cls.overlaps and self.world > 1
        super().__init__(params, {"lr": cfg.optim.lr})
        self.sync_hooks: list = []
        self.started = False          # the first sync made (or a state loaded)
        self.k = 0                    # outer steps completed
        self.j = 0                    # inner steps taken in outer step k + 1
        self.plans: dict = {}         # outer step -> Plan, as received from rank 0
        self.speeds = [0.0] * self.world   # every replica's seconds per inner step, smoothed (balance)
        self.inflight: Optional[_InFlight] = None
        self.last_rows = torch.zeros(self.world, len(SLOT), dtype=torch.float64)
        self.dist_prev = 0.0          # ||x[a] - xbar|| after the newest sync
        self.ref_n = self.world       # how many replicas the reference averages
        self.overlapped_syncs = 0
        self.skipped_steps = 0        # inner steps whose gradients overflowed (fp16 under a GradScaler)
        self._losses: list = []
        self._timer: Optional[InnerTimer] = None
        self._t_step = 0.0

    # ------------------------------------------------------------------ the user's calls
    @property
    def module(self) -> nn.Module:
        """What to call forward on: the model, or DDP's wrapper of it (dpsgd under torch.distributed)."""
        return self.algo.module

    def register_sync_hook(self, fn: Callable[[SyncReport], None]) -> None:
        """``fn(report)`` after every sync, on every rank, before the non-finite check."""
        self.sync_hooks.append(fn)

    def next_plan(self) -> Plan:
        """The plan of the outer step the next ``step()`` belongs to; this replica takes
        ``next_plan().steps[rank]`` inner steps in it. May start or wait for a sync: all
        ranks reach this alike."""
        if not self.started:
            self.start()
        k = self.k + 1
        if k not in self.plans:
            self.synchronize()
        if self.j == 0 and self._timer is None:     # the step's clock: from before its first forward
            self._timer, self._t_step = InnerTimer(self.dev), time.monotonic()
        return self.plans[k]

    def step(self, closure=None, *, loss: Optional[torch.Tensor] = None):
        """One inner step from the gradients in ``.grad``; ``loss`` (or the closure's) is
        reported in this replica's slot row and checked for finiteness. The call that ends an
        outer step makes its outer update and starts its sync: all ranks reach this."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.j == 0:
            self._begin_outer()
        if self._overflowed():
            # an overflow of the scaled fp16 gradients (GradScaler): no update, no noise drawn,
            # but the step counts, so that every rank still reaches the sync at the same call
            self.skipped_steps += 1
            self.algo.skip_step()
        else:
            self.algo.inner_step(gk=self._plan.gk, rk=self._plan.rk, lr=self.param_groups[0]["lr"],
                                 xbar=self.ref_params)
            if loss is not None:
                self._losses.append(loss.detach())
        self.j += 1
        if self.j >= self._plan.steps[self.rank]:
            self._end_outer()
        return loss

    def _overflowed(self) -> bool:
        """Under ``GradScaler.step``: whether the scaled gradients overflowed (then nothing is
        updated); if not, they are unscaled here, in place."""
        found, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found is None:
            return False
        if float(found) > 0:          # one device sync per inner step, under fp16 only
            return True
        if scale is not None:         # not yet unscaled by the user's scaler.unscale_
            grads = [p.grad for p in self.param_groups[0]["params"] if p.grad is not None]
            if grads:                 # as GradScaler.unscale_: times 1/scale, exact (a power of 2)
                torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
        return False

    def synchronize_gradients(self) -> None:
        """dpsgd: wait for this step's gradient allreduce now (Horovod's; DDP's is done in
        backward), so that a GradScaler's overflow check sees the averaged gradients, the
        same on every rank. Other algorithms: nothing. Call it after the last backward of
        an inner step, before ``scaler.step``; all ranks reach this alike."""
        self.algo.sync_grads()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside it add to ``.grad`` without a
        gradient allreduce (dpsgd under DDP; Horovod counts ``accum`` backward passes per
        step itself); the last micro-batch's backward runs outside it."""
        with self.algo.no_sync():
            yield

    def synchronize(self) -> None:
        """Wait for the sync in flight (``overlap``), if any. All ranks reach this alike."""
        if self.inflight is not None:
            self._receive(self.k)

    def reference_model(self) -> nn.Module:
        """The module that holds the reference (after any sync in flight; algorithms without
        a sync form it here: rank 0's replica, broadcast). All ranks reach this."""
        if not self.started:
            self.start()
        self.synchronize()
        with self._guard("reference", self.k):
            self.algo.form_reference(self.model_t, self.ref_t)      # all ranks reach this
        return self.ref_model

    @contextlib.contextmanager
    def reference(self, *, form: bool = True):
        """``with opt.reference(): evaluate(model)``: the reference's weights (and BatchNorm
        buffers) in the model, the replica's restored afterwards; the same tensors, so a
        compiled model is not recompiled. All ranks reach this (``form=False``: the
        reference as ``reference_model()`` last formed it, no collective)."""
        if form:
            self.reference_model()
        saved = [t.detach().clone() for t in self.model_t]
        with torch.no_grad():
            for m, r in zip(self.model_t, self.ref_t):
                m.copy_(r)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for m, s in zip(self.model_t, saved):
                    m.copy_(s)

    def state_dict(self) -> dict:
        """Everything a resume needs beyond the model's ``state_dict`` (live tensors: copy
        before keeping): the group's hyper-parameters, the algorithm's buffers, the
        reference, the plans and counters; mid outer step, Parle's x[a] and z too. Waits for
        a sync in flight (or makes the first sync): all ranks reach this alike."""
        if not self.started:
            self.start()
        self.synchronize()
        g = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        sd = {"step": self.k, "inner": self.j, "param_groups": [g], "ref": self.ref_model.state_dict(),
              "algo_state": self.algo.state_dict(), "plans": self.plans_state(), "speeds": list(self.speeds),
              "overlapped_syncs": self.overlapped_syncs, "dist_prev": self.dist_prev, "ref_n": self.ref_n,
              "skipped_steps": self.skipped_steps,
              "sched": list(self.plans[self.k + 1][:3]) if self.k + 1 in self.plans else []}
        if self.j:                      # inside an outer step: its losses so far, and Parle's x[a] and z
            p = self._plan               # the plan this step runs (plans[k+1] may be newer: overlap, balance)
            sd["mid"] = {"losses": list(self._losses), "plan": [p.gk, p.rk, p.lr, list(p.steps)]}
            if self._parle_mid():
                sd["mid"].update(x=self.algo.opt.x, z=self.algo.opt.z)
        return sd

    def _parle_mid(self) -> bool:
        return hasattr(self.algo, "opt") and hasattr(self.algo.opt, "z") and hasattr(self.algo, "in_outer")

    def load_state_dict(self, sd: dict) -> None:
        """Back to ``sd`` (after the model's own ``load_state_dict``: Parle's x[a] and z start
        from the model's weights). A checkpoint from before plans has only ``sched``."""
        self.ref_model.load_state_dict(sd["ref"])
        self.algo.load_state_dict(sd["algo_state"])
        for k, v in (sd.get("param_groups") or [{}])[0].items():
            self.param_groups[0][k] = v
        self.k, self.j, self.dist_prev = sd["step"], sd.get("inner", 0), sd["dist_prev"]
        self.speeds = list(sd.get("speeds", [0.0] * self.world))
        self.load_plans(sd.get("plans") or {self.k + 1: [*sd["sched"], [self.L] * self.world]})
        self.overlapped_syncs = sd.get("overlapped_syncs", 0)
        self.skipped_steps = sd.get("skipped_steps", 0)
        self.ref_n = sd.get("ref_n", self.world)
        self.inflight, self._timer = None, None
        if self.j:                      # resumed inside an outer step
            p = sd["mid"].get("plan")
            self._plan = Plan(p[0], p[1], p[2], tuple(p[3])) if p else self.plans[self.k + 1]
            if self._parle_mid():
                self.algo.in_outer = True
                with torch.no_grad():
                    for d, s in zip(self.algo.opt.x + self.algo.opt.z, sd["mid"]["x"] + sd["mid"]["z"]):
                        d.copy_(s)
            self._losses = [t.clone() for t in sd["mid"]["losses"]]
            self._timer, self._t_step = InnerTimer(self.dev), time.monotonic()

    # ------------------------------------------------------------------ the sync
    def start(self) -> None:
        """The first sync: the first reference from the replicas as they are, and rank 0's
        plans for outer steps 1 and 2. The first ``step()`` calls it. All ranks reach this."""
        if self.algo.syncs:
            with self._guard("first sync", 0):
                plans, _ = sync(self.model_t, self.ref_t, self.ex, self._plans_after(0) if self.rank == 0 else None,
                                {c: 0 for c in SLOT})           # all ranks reach this
            self.plans = {1 + i: p for i, p in enumerate(plans)}
            self.dist_prev = replica_distance(self.algo.anchor(), self.ref_params)
            self.algo.after_sync(self.model_t, self.ref_t)
        else:
            self.plans = {1: self._plan_of(1)}
        self.started = True

    def _begin_outer(self) -> None:
        self._plan = self.next_plan()
        if math.isfinite(self._plan.lr):
            for g in self.param_groups:
                g["lr"] = self._plan.lr
        self._losses = []               # (next_plan started the step's clock)
        self.algo.begin_outer()

    def _end_outer(self) -> None:
        k, plan = self.k + 1, self._plan
        # every rank enters this guard alike, once per outer step (a GPU waits in it for the
        # stream of the inner steps), so the heartbeats' counts stay in step
        t_inner, self._timer = self._timer.seconds(self._guard("inner loop", k)), None
        if self.inflight is not None:
            self._receive(k)                       # overlap: step k-1's sync, waited for only now
        self._outer_update(k, plan)
        if _injected("PARLE_HVD_INJECT_NAN", self.rank, k):
            with torch.no_grad():
                self.algo.params[0].fill_(float("nan"))
        self._send(k, plan, self._slot(k, t_inner))       # all ranks reach this
        self.k, self.j = k, 0
        if not self.overlap or k + 1 not in self.plans:
            self._receive(k)                       # this step's own sync: all ranks wait here alike

    def _outer_update(self, k: int, plan: Plan) -> None:
        dump = os.environ.get("PARLE_HVD_DUMP_OUTER")     # testing hook (tests/test_overlap.py)
        if dump:
            opt = self.algo.opt
            before = {"x": [t.clone() for t in opt.x], "z": [t.clone() for t in opt.z],
                      "v_out": [t.clone() for t in opt.v_out], "xbar": [t.clone() for t in self.ref_params]}
        lr = self.param_groups[0]["lr"]
        self.algo.end_outer(self.ref_params, rk=plan.rk, lr=lr)
        if dump:
            torch.save({**before, "after": [p.detach().clone() for p in self.algo.params], "rk": plan.rk,
                        "lr": lr, "steps": plan.steps, "step": k},
                       os.path.join(dump, f"outer-rank{self.rank}-step{k}.pt"))

    def _slot(self, k: int, t_inner: float) -> dict:
        """This replica's row in the sync of outer step k."""
        checks = [torch.isfinite(p).all() for p in self.algo.params]
        if self._losses:
            lt = torch.stack(self._losses).double()
            loss, loss_max, finite = torch.stack([lt.mean(), lt.max(), torch.stack([torch.isfinite(lt).all(), *checks])
                                                  .all().double()]).tolist()     # one device sync
        else:
            loss, loss_max, finite = float("nan"), float("nan"), float(torch.stack(checks).all())
        fake = _fake_step_seconds(self.rank)
        n = max(self._plan.steps[self.rank], 1)
        row = {"loss": loss, "loss_max": loss_max, "distance": self.dist_prev, "nonfinite": float(not finite),
               "stop": 0.0, "ckpt": 0.0, "hosts": 0.0, "step_seconds": fake if fake is not None else t_inner / n}
        if self.flags is not None:
            row.update({c: float(v) for c, v in self.flags(k).items()})
        return row

    def _plan_of(self, j: int) -> Plan:
        """Outer step j's plan: the schedule, and each replica's inner steps: L, or with
        balance a share of n*L in proportion to its measured speed."""
        steps = balance_steps(self.speeds, total=self.world * self.L) if self.balance else [self.L] * self.world
        return Plan(*self.schedule(j), tuple(steps))

    def _plans_after(self, k: int) -> list:
        """Rank 0's plans for steps k+1 and k+2, sent in step k's sync (Exchange.AHEAD)."""
        return [self._plan_of(k + 1 + i) for i in range(Exchange.AHEAD)]

    def _send(self, k: int, plan: Plan, slot: dict) -> None:
        """Start outer step k's one collective. All ranks reach this, once per outer step."""
        now = time.monotonic()
        if self.algo.syncs:
            pending = sync_start(self.model_t, self.ref_t, self.ex, self._plans_after(k) if self.rank == 0 else None,
                                 slot)                 # all ranks reach this
            self.inflight = _InFlight(k, plan, self._t_step, now, pending, None)
        else:
            self.plans[k + 1] = self._plan_of(k + 1)
            with self._guard("slots", k):
                rows = exchange_slots(slot, self.rank, self.world)   # all ranks reach this
            self.inflight = _InFlight(k, plan, self._t_step, now, None, rows)

    def _receive(self, k: int) -> None:
        """Wait for the sync in flight (outer step k, or k-1 with overlap), read rank 0's
        plans and every replica's row, then the hooks and the non-finite check. Every rank
        sees the same rows, so all act alike."""
        rec, self.inflight = self.inflight, None
        if rec.pending is not None:
            with self._guard("sync", rec.step):
                rec.pending.wait()                     # the allreduce started in _send, on every rank
            plans, rows = self.ex.unpack()
            self.plans.update({rec.step + 1 + i: p for i, p in enumerate(plans)})
            self.ref_n = self.world
            self.dist_prev = replica_distance(self.algo.anchor(), self.ref_params)
            self.algo.after_sync(self.model_t, self.ref_t)
        else:
            rows = rec.rows
        for j in [j for j in self.plans if j <= rec.step]:
            del self.plans[j]
        for a, sec in enumerate(rows[:, SLOT.index("step_seconds")].tolist()):
            if sec > 0:                                # smoothed: one slow step must not swing the plan
                self.speeds[a] = sec if self.speeds[a] <= 0 else 0.5 * self.speeds[a] + 0.5 * sec
        self.last_rows = rows
        overlapped = rec.pending is not None and rec.step < k
        self.overlapped_syncs += overlapped
        report = SyncReport(rec.step, rec.plan, rows, (time.monotonic() if rec.step == k else rec.t_sent) - rec.t_start,
                            overlapped)
        for fn in self.sync_hooks:
            fn(report)
        bad = [a for a in range(len(rows)) if rows[a, SLOT.index("nonfinite")] > 0]
        if bad:
            raise NonFiniteError(f"non-finite loss or weights on rank(s) {bad} at outer step {rec.step}")

    # ------------------------------------------------------------------ plans and worlds
    def plans_state(self) -> dict:
        """The plans received and not yet used, as lists (a checkpoint's, an elastic commit's)."""
        return {j: [p.gk, p.rk, p.lr, list(p.steps)] for j, p in self.plans.items()}

    def load_plans(self, plans: dict) -> None:
        """Back to ``plans_state()``'s plans (a resume, or a replica joining an elastic run)."""
        self.plans = {int(j): Plan(p[0], p[1], p[2], tuple(p[3])) for j, p in plans.items()}
        self.started = True
        self.resize(self.world, self.rank)

    def resize(self, world: int, rank: int) -> None:
        """After the world changed (elastic mode, where balance is off): the sync's layout for
        the new world, and L inner steps for every replica in the plans."""
        if (world, rank) != (self.world, self.rank):
            self.world, self.rank = world, rank
            self.ex = Exchange(world, rank, self.ex.dtype)
            self.algo.world, self.algo.rank = world, rank
        self.speeds = (self.speeds + [0.0] * world)[:world]
        self.plans = {j: p if len(p.steps) == world else p._replace(steps=(self.L,) * world)
                      for j, p in self.plans.items()}


# ---------------------------------------------------------------------- make()
_SYNC_PERIOD = {"parle": "parle", "entropy": "parle", "elastic": "elastic", "localsgd": "localsgd",
                "diloco": "diloco", "sgd": "train.block", "dpsgd": "train.block"}
_SECTIONS = {"parle": ("parle",), "entropy": ("entropy", "parle"), "elastic": ("elastic", "parle"),
             "localsgd": ("localsgd",), "diloco": ("diloco",), "sgd": (), "dpsgd": ("dpsgd",)}
_NOT_HYPER = {"sync_period", "overlap", "balance", "momentum"}


def _hyper_names(section: str) -> list:
    import dataclasses
    from . import config as C
    cls = {"parle": C.ParleConfig, "entropy": C.EntropyConfig, "elastic": C.ElasticConfig, "localsgd": C.LocalSGDConfig,
           "diloco": C.DiLoCoConfig, "dpsgd": C.DPSGDConfig}[section]
    return [f.name for f in dataclasses.fields(cls) if f.name not in _NOT_HYPER]


def make(algo: str, model: nn.Module, *, lr: float, sync_period: Optional[int] = None,
         momentum: Optional[float] = None, nesterov: bool = True, weight_decay: float = 0.0,
         batches_per_pass: Optional[int] = None, overlap: bool = False, balance: str = "off", seed: int = 42,
         schedule: Optional[Callable[[int], tuple]] = None, watchdog=None, **hyper) -> DistributedOptimizer:
    """``algo``'s optimizer for ``model`` (this rank's replica); every rank calls it.

    ``lr``: the group's learning rate (parle: the outer ``lr_k``, and the inner rate held at
    this value). ``sync_period``: L, inner steps per outer step. ``momentum`` (default 0.9;
    elastic: its step's momentum, default 0), ``nesterov``, ``weight_decay``: as torch's SGD.
    ``batches_per_pass``: mini-batches in one pass over this replica's data, the clock of
    PARLE.md's scoping ``gk = min(gamma0_inv (1 + s/nb)^k, gamma_min_inv)`` (and ``rk``
    alike); parle, entropy and elastic need it. ``overlap``, ``balance="time"``: parle only.
    Other keywords are the algorithm's own, by the config keys' names: parle's ``alpha``,
    ``gamma0_inv``, ``gamma_min_inv``, ``rho0_inv``, ``rho_min_inv``, ``scoping`` (s),
    ``init``; entropy's ``noise``; diloco's ``inner``, ``inner_lr``, ``outer_lr``,
    ``outer_momentum``; dpsgd's ``fp16``, ``bucket_mb``, ``lr_scale``. A bad value raises
    ``ValueError`` naming it, on every rank alike, before any collective."""
    if algo not in ALGORITHMS:
        raise ValueError(f"parle_hvd.optim.make: unknown algorithm {algo!r} (known: {', '.join(ALGORITHMS)})")
    d: dict = {"algo": algo, "optim": {"lr": lr, "nesterov": nesterov, "weight_decay": weight_decay,
                                       "schedule": "constant"}, "train": {"seed": seed}, "parle": {}}
    if momentum is not None:
        d.setdefault("elastic" if algo == "elastic" else "optim", {})["momentum"] = momentum
    if sync_period is not None:
        sec = _SYNC_PERIOD[algo]
        d.setdefault(sec.split(".")[0], {})["block" if sec == "train.block" else "sync_period"] = sync_period
    d["parle"].update(overlap=overlap, balance=balance)
    for key, v in hyper.items():
        sec = next((s for s in _SECTIONS[algo] if key in _hyper_names(s)), None)
        if sec is None:
            known = sorted({n for s in _SECTIONS[algo] for n in _hyper_names(s)})
            raise TypeError(f"parle_hvd.optim.make: {algo} takes no keyword {key!r}"
                            + (f" (its own: {', '.join(known)})" if known else ""))
        d.setdefault(sec, {})[key] = v
    try:
        cfg = _build(Config, d, "")
    except ConfigError as e:
        raise ValueError(f"parle_hvd.optim.make: {e}") from None
    P = cfg.parle
    if schedule is None:
        couples = algo in ("parle", "entropy", "elastic")
        if couples and P.scoping == "auto":
            raise ValueError("parle_hvd.optim.make: scoping='auto' needs the run's length; pass schedule=")
        if couples and not (isinstance(batches_per_pass, int) and batches_per_pass > 0):
            raise ValueError(f"parle_hvd.optim.make: {algo} needs batches_per_pass= (mini-batches in one pass "
                             f"over this replica's data), the clock of its couplings; got {batches_per_pass!r}")
        L = {"parle": P.sync_period, "entropy": P.sync_period, "elastic": cfg.elastic.sync_period}.get(algo, 1)

        def schedule(k: int) -> tuple:
            if not couples:
                return 0.0, 0.0, math.nan
            gk, rk = scoping(k * L / P.sync_period, gamma0_inv=P.gamma0_inv, gamma_min_inv=P.gamma_min_inv,
                             rho0_inv=P.rho0_inv, rho_min_inv=P.rho_min_inv, scoping=P.scoping, nb=batches_per_pass)
            return gk, rk, math.nan          # nan: the group's lr, as the user's scheduler leaves it
    opt = DistributedOptimizer(model, cfg, schedule=schedule, watchdog=watchdog)
    opt.start()          # the first reference, before any forward moves BatchNorm's buffers (as train.py)
    return opt
