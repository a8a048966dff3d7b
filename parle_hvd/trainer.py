"""The Parle training loop: one MPI rank = one replica.

    horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
    mpirun -np 4 python train.py --config configs/fashion_parle.yaml parle.sync_period=50
    horovodrun --gloo -np 3 --min-np 2 --max-np 4 --host-discovery-script launch/discover_hosts.sh \
        python train.py --config configs/fashion_parle.yaml --elastic          # launch/elastic.sh

Read top to bottom: set up (rank 0 resolves the run, all ranks load data and build their
replica), one initial sync, then K outer steps of [L inner steps, outer update, one sync],
with evaluations and checkpoints between syncs.

The one sync per outer step is ONE fused allreduce carrying, in one flat buffer:
  * the replica's parameters and BatchNorm buffers (averaged: the reference);
  * rank 0's schedule values for the next outer step (gk, rk, lr_k; other ranks send 0,
    so the sum is rank 0's value: a broadcast folded into the allreduce);
  * one slot row per replica (only that replica's row is non-zero, so the sum gathers
    every replica's training loss, its distance to the reference and a non-finite flag).
An evaluation is one more allreduce (float64 sums of correct, loss, count). So a run of
K outer steps with E evaluations makes exactly K + 1 + E allreduces (the +1 forms the
first reference from the independently initialised replicas).

Elastic mode (dist.elastic): Horovod's elastic.run calls ``Trainer.loop``; each rank
commits its state (the checkpoint dict) to host memory at the end of an outer step; a
failed rank sends the others back to their last commit, in a smaller world; a new rank
starts at the reference (``Trainer._elastic_sync``). docs/robustness.md has the details.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint, comm
from .config import Config, to_dict
from .data import ReplicaSampler, augment_batch, common_nb, hold_out, load_dataset, replica_indices, to_input, _gen
from .logger import RunLogger
from .models import build_model, sync_tensors
from .algorithms import ALGORITHMS
from .checkpoint import CheckpointError
from .watchdog import StopSignal, Watchdog
from .parle import lr_at, scoping, scoping_auto

# one row per replica in every sync; "ckpt": this rank could not write its last checkpoint
SLOT = ("loss", "loss_max", "distance", "nonfinite", "stop", "hosts", "ckpt")
SCHED = ("gk", "rk", "lr")                               # rank 0's values for the next step


class RunError(RuntimeError):
    """A problem with the run itself (directory, resume); one line, exit 2."""


class DivergenceError(RuntimeError):
    """Non-finite loss or weights; one line, exit 3, the last complete checkpoint kept."""


def _injected(hook: str, rank: int, step: int) -> bool:
    """Testing hooks (tests/test_robustness.py), "<rank>:<outer step>":
    PARLE_HVD_INJECT_NAN poisons that replica's weights after that outer step's inner loop;
    PARLE_HVD_INJECT_STOP acts as if a SIGTERM reached that rank during that outer step."""
    return os.environ.get(hook, "") == f"{rank}:{step}"


# --------------------------------------------------------------------------- the exchange
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


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def recompute_bn(ref: nn.Module, ds, batches: int, batch_size: int, seed: int, step: int, dtype,
                 dev: torch.device) -> None:
    """Re-estimate the reference's BatchNorm statistics on ``batches`` training batches.
    Every rank uses the same batches (a shuffle seeded by seed and step), so the ranks'
    references stay identical without a collective."""
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
    perm = torch.randperm(len(ds.train_x), generator=_gen("bn", seed, step))
    for i in range(min(batches, len(perm) // batch_size or 1)):
        idx = perm[i * batch_size:(i + 1) * batch_size]
        ref(to_input(ds.train_x[idx].to(dev), ds.mean, ds.std, dtype))
    for m, mom in saved:
        m.momentum = mom
    ref.eval()


@torch.no_grad()
def _shard_sums(ref: nn.Module, x_all, y_all, ds, rank: int, world: int, batch_size: int, dtype, dev) -> list:
    """[correct, summed loss, count] of the reference on this rank's shard of (x_all, y_all)."""
    n = len(x_all)
    lo, hi = (rank * n) // world, ((rank + 1) * n) // world
    correct = loss = 0.0
    for i in range(lo, hi, batch_size):
        x = to_input(x_all[i:min(i + batch_size, hi)].to(dev), ds.mean, ds.std, dtype)
        y = y_all[i:min(i + batch_size, hi)].to(dev)
        out = ref(x)
        loss += float(F.cross_entropy(out, y, reduction="sum"))
        correct += float((out.argmax(1) == y).sum())
    return [correct, loss, float(hi - lo)]


@torch.no_grad()
def evaluate(ref: nn.Module, ds, rank: int, world: int, batch_size: int, dtype, dev: torch.device, extra: list):
    """Test loss and accuracy of the reference (and, with a validation split, its
    validation loss and accuracy), each set sharded across ranks and the sums allreduced in
    float64 together with ``extra`` slot rows: one allreduce. All ranks reach this.
    Returns (test acc, test loss, rows, (valid acc, valid loss) or None)."""
    ref.eval()
    parts = _shard_sums(ref, ds.test_x, ds.test_y, ds, rank, world, batch_size, dtype, dev)
    if ds.val_x is not None:
        parts += _shard_sums(ref, ds.val_x, ds.val_y, ds, rank, world, batch_size, dtype, dev)
    sums = torch.tensor(parts, dtype=torch.float64)
    rows = torch.zeros(world, len(extra), dtype=torch.float64)
    rows[rank] = torch.tensor(extra, dtype=torch.float64)
    comm.allreduce_sum_([sums, rows], name="eval")   # all ranks reach this
    v = sums.tolist()
    valid = (v[3] / v[5], v[4] / v[5]) if len(v) > 3 else None
    return v[0] / v[2], v[1] / v[2], rows, valid


# --------------------------------------------------------------------------- run setup
def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    try:
        import horovod
        v["horovod"] = horovod.__version__
    except ImportError:
        v["horovod"] = None
    from . import __version__
    v["parle_hvd"] = __version__
    return v


def resolve_run_dir(cfg: Config) -> tuple[Path, Optional[Path]]:
    """Rank 0 only: the run directory, created and checked writable, and the topmost
    directory this call created (None if the run directory existed): a start that fails
    removes that again if the run directory holds nothing (``discard_if_empty``)."""
    if cfg.run.dir:
        d = Path(cfg.run.dir)
    elif cfg.run.resume:
        cands = sorted(Path("runs").glob(f"{cfg.run.name}-*"), key=lambda p: p.stat().st_mtime)
        cands = [c for c in cands if checkpoint.steps(c)]
        if not cands:
            raise RunError(f"run.resume: no runs/{cfg.run.name}-* directory with a checkpoint; set run.dir")
        d = cands[-1]
    else:
        d = Path("runs") / f"{cfg.run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    created = None
    if not d.exists():
        created = d
        while not created.parent.exists():
            created = created.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunError(f"run.dir: cannot write to {d} ({e.strerror or e})") from None
    return d, created


def discard_if_empty(d: Path, created: Path) -> None:
    """What a start that failed leaves behind: remove ``created`` (the run directory ``d``
    or the topmost directory above it that the start made, e.g. ``runs/``) if ``d`` holds
    no file but the watchdog's heartbeats."""
    d = Path(d)
    try:
        if any(p.is_file() for p in d.rglob("*") if ".heartbeat" not in p.relative_to(d).parts):
            return
        shutil.rmtree(created, ignore_errors=True)
    except OSError:
        pass


def _start(cfg: Config, rank: int) -> tuple[Config, Path, list, int, Optional[Path]]:
    """Rank 0 resolves the run directory and the checkpoint steps a resume may use (newest
    first, complete by their file names; ``agree_on_checkpoint`` then checks they load) and
    the number of ranks that wrote them, and sends them and its config to every rank (one
    source of truth even if the ranks' configs differ). An elastic run may resume a
    checkpoint written by another number of ranks; any other run needs its own number.
    Returns (config, run dir, steps, their world size, the directory rank 0 created or None)."""
    msg = None
    world = comm.size()
    created = None
    if rank == 0:
        d = None
        try:
            d, created = resolve_run_dir(cfg)
            cfg.run.dir = str(d)
            steps, ckpt_world = [], world
            if cfg.run.resume:
                if cfg.dist.elastic:
                    _, ckpt_world = checkpoint.latest_complete_any(d) or (None, world)
                steps = checkpoint.complete_steps(d, ckpt_world)
                if not steps:
                    raise RunError(f"run.resume: no complete checkpoint for {world} ranks in {d}/checkpoints"
                                   if not cfg.dist.elastic else f"run.resume: no complete checkpoint in {d}/checkpoints")
            msg = {"cfg": cfg, "steps": steps, "ckpt_world": ckpt_world}
        except RunError as e:
            if created:
                discard_if_empty(d, created)
            msg = {"error": str(e)}
    mine = to_dict(cfg)
    msg = comm.broadcast_object(msg)           # all ranks reach this
    if "error" in msg:
        raise RunError(msg["error"])
    theirs = to_dict(msg["cfg"])
    diff = sorted(f"{s}.{k}" for s in theirs if isinstance(theirs[s], dict)
                  for k in theirs[s] if mine[s][k] != theirs[s][k] and not (s == "run" and k in ("dir", "name")))
    if rank != 0 and diff:
        print(f"[rank {rank}] warning: config differs from rank 0's in {', '.join(diff)}; using rank 0's",
              file=sys.stderr, flush=True)
    return msg["cfg"], Path(msg["cfg"].run.dir), msg["steps"], msg["ckpt_world"], created


def agree_on_checkpoint(run_dir: Path, steps: list, rank: int, ckpt_world: int) -> tuple[Optional[int], dict, dict]:
    """Every rank tries to load its file of the complete ``steps`` (newest first); the ranks
    agree on the newest step that loads on every rank. Returns ``(step, this rank's state,
    {skipped step: this rank's error})``; step is None if no step loads everywhere.

    A round is one small allreduce of two flags per step (failed here, loaded here); each
    rank loads only what it must: its newest loadable file, then whatever step the round
    chose that it has not tried. Decisions follow the summed flags only, so every rank makes
    the same number of rounds. A rank without a replica in the checkpoint (an elastic run
    resumed on more ranks) loads nothing and agrees to every step. All ranks reach this."""
    tried: dict = {}

    def load(i: int) -> bool:
        if i not in tried:
            if rank >= ckpt_world:
                tried[i] = {}
            else:
                try:
                    tried[i] = checkpoint.load(run_dir, steps[i], rank)
                except CheckpointError as e:
                    tried[i] = e
        return not isinstance(tried[i], CheckpointError)

    world, i = comm.size(), 0
    while True:
        # my newest loadable step, at index i or later: the steps before it fail here
        j = i
        while j < len(steps) and not load(j):
            j += 1
        flags = torch.zeros(2, len(steps) + 1, dtype=torch.float64)
        for t, v in tried.items():
            flags[0 if isinstance(v, CheckpointError) else 1, t] = 1.0
        comm.allreduce_sum_([flags], name="resume.agree")        # all ranks reach this
        ok = [t for t in range(i, len(steps)) if flags[0, t] == 0]
        if not ok:
            errors = {steps[t]: str(v) for t, v in tried.items() if isinstance(v, CheckpointError)}
            return None, {}, errors
        t = ok[0]
        if flags[1, t] == world:                 # loaded on every rank
            errors = {steps[u]: str(v) for u, v in tried.items() if isinstance(v, CheckpointError) and u < t}
            return steps[t], tried[t], errors
        for u in list(tried):
            if u < t and not isinstance(tried[u], CheckpointError):
                tried.pop(u)                     # newer than any possible agreement: free its state
        load(t)                                  # the step every rank could still agree on: try it here
        i = t


def pick_device(want: str) -> torch.device:
    """One GPU per rank (its local rank), or the CPU."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RunError("dist.device: cuda requested but torch.cuda.is_available() is False")
    n = torch.cuda.device_count()
    if comm.local_size() > n:
        raise RunError(f"dist.device: {comm.local_size()} ranks on this host but {n} GPU(s); "
                       f"start one rank per GPU")
    torch.cuda.set_device(comm.local_rank())
    return torch.device("cuda", comm.local_rank())


# --------------------------------------------------------------------------- the run
def _host_copy(obj):
    """A deep copy with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class Trainer:
    """One rank's run: its replica, the reference, and the loop.

    Without elastic mode ``run()`` is ``start()`` (rank 0 resolves the run directory and
    any checkpoint; every rank builds its replica; then the first sync, or the resume)
    followed by ``loop()``. In elastic mode (``dist.elastic``) Horovod's ``elastic.run``
    drives the same ``loop()``; what it commits at the end of every outer step is this
    rank's checkpoint dict, kept in memory, and ``_elastic_sync`` takes the place of
    ``start()`` (docs/robustness.md, "Elastic mode")."""

    def __init__(self, cfg: Config):
        comm.init(cfg.dist.backend, set_threads=cfg.dist.threads == 0, timeout=cfg.dist.timeout)
        if cfg.dist.threads:
            torch.set_num_threads(cfg.dist.threads)
        self.cfg = cfg
        self.rank, self.world = comm.rank(), comm.size()
        self.stop = StopSignal(self.rank)
        self.stop.install()
        self.dog = Watchdog(cfg.dist.timeout, self.rank, self.world)
        self.elastic = None          # Horovod's elastic state (elastic mode)
        self.committed = None        # elastic mode: this rank's last commit
        self.events: list = []       # elastic mode: every change of the world, for the summary
        self.commit_seconds = 0.0    # elastic mode: time spent committing (this process)
        self.restored = False
        self.ckpt_error = None       # this rank's failed checkpoint write, reported at the next sync
        self.removal_only = False    # elastic mode: the interrupt in flight removes hosts only (no sync follows)
        self.created_dir = None      # what rank 0 made for the run directory in this start (removed if the start fails)
        self.log = None
        self.ds = None
        self.built = False
        self.resumed_from = None
        self.ckpt_world = self.world
        self.t_start = time.monotonic()

    def run(self) -> dict:
        cfg = self.cfg
        if not cfg.dist.elastic:
            if cfg.dist.expect_ranks and cfg.dist.expect_ranks != self.world:
                raise RunError(f"dist.expect_ranks: this config is meant for {cfg.dist.expect_ranks} ranks, "
                               f"launched with {self.world} (override dist.expect_ranks=0 to run anyway)")
            self.start()
            return self.loop()
        if not comm.elastic_launched():
            raise RunError("dist.elastic: start the job with horovodrun's elastic mode (launch/elastic.sh: "
                           "--min-np, --max-np, --host-discovery-script)")
        self.elastic = comm.elastic_state(save=self._commit, restore=self._restore, sync=self._elastic_sync,
                                          reset=self._on_reset)
        return comm.elastic_run(lambda state: self.loop(), self.elastic)

    # ----------------------------------------------------------------------- building
    def _build(self, replica_id: int, world0: int, *, init_bcast: bool) -> None:
        """This rank's replica: data, sampler, model, algorithm, and the loop's counters.
        ``replica_id`` names the replica (its seed, its data order and window): the rank,
        except for a replica that joins an elastic run. ``world0`` is the world size the
        data windows were cut for."""
        cfg, rank, world = self.cfg, self.rank, self.world
        P, O = cfg.parle, cfg.optim
        self.dtype = dtype = getattr(torch, cfg.model.dtype)
        self.dev = dev = pick_device(cfg.dist.device)
        algo_cls = ALGORITHMS[cfg.algo]
        self.replica_id, self.world0 = replica_id, world0

        # Data: every replica holds the whole dataset in memory (uint8) and its own window/order;
        # data-parallel SGD gives each rank a disjoint shard instead.
        if self.ds is None:
            self.ds = load_dataset(cfg.data.name, cfg.data.dir, cfg.data.train_limit, cfg.data.test_limit, cfg=cfg.data,
                                   seed=cfg.train.seed)
            if cfg.data.val_frac:       # the same split on every rank: it depends on the seed only
                self.ds = hold_out(self.ds, cfg.data.val_frac, seed=cfg.train.seed)
        ds = self.ds
        # dpsgd: frac = 1/n cuts disjoint shards that cover the data (data.window_bounds)
        split, frac = (("frac", 1.0 / world0) if algo_cls.shard_data and world0 > 1 else (cfg.data.split, cfg.data.frac))
        idx = replica_indices(len(ds.train_x), rank=replica_id, world=world0, split=split, frac=frac, seed=cfg.train.seed)
        # the same number of batches per pass on every replica, whatever its window's size
        nb = common_nb(len(ds.train_x), world=world0, split=split, frac=frac, batch_size=cfg.train.batch_size)
        self.sampler = ReplicaSampler(idx, cfg.train.batch_size, seed=cfg.train.seed, rank=replica_id, nb=nb)
        self.nb = nb = self.sampler.nb

        # Replica: independent initialisation (seed + replica) unless asked to start from rank 0's.
        torch.manual_seed(cfg.train.seed + replica_id)
        random.seed(cfg.train.seed + replica_id)
        np.random.seed((cfg.train.seed + replica_id) % 2**32)
        self.model = build_model(cfg.model.name, num_classes=ds.num_classes, in_channels=ds.shape[0],
                                 image_size=ds.shape[1], dropout=cfg.model.dropout, depth=cfg.model.depth,
                                 width=cfg.model.width).to(device=dev, dtype=dtype)
        if init_bcast and (P.init == "broadcast" or algo_cls.same_init):
            with self.dog.collective("initial broadcast", 0):
                comm.broadcast_(list(self.model.state_dict().values()), name="init")   # all ranks reach this
        self.ref = copy.deepcopy(self.model)
        self.algo = algo_cls(self.model, cfg, world, rank)
        self.L = L = self.algo.L
        # The same on every rank: window sizes do not depend on the rank.
        self.K = max(1, math.ceil(cfg.train.epochs * nb / L))
        self.eval_every_steps = max(1, round(cfg.eval.every * nb / L))
        self.log_every_steps = max(1, math.ceil(cfg.run.log_every / L))
        self.model_t, self.ref_t = sync_tensors(self.model), sync_tensors(self.ref)
        self.ref_params = list(self.ref.parameters())
        self.ex = Exchange(world, rank, dtype)
        self.aug_gen = _gen("augment", cfg.train.seed, replica_id)
        self.n_params = sum(p.numel() for p in self.model.parameters())

        self.schedule = lambda k: outer_schedule(k, L=L, nb=nb, parle=P, optim=O, epochs=cfg.train.epochs)

        # State carried across outer steps (and checkpoints).
        self.k, self.wall_before, self.evals, self.samples, self.dist_prev = 0, 0.0, 0, 0, 0.0
        self.eval_wall = 0.0         # seconds spent evaluating (in wall()): time to accuracy can leave it out
        self.sched = None
        self.ref_n = world           # how many replicas the current reference averages
        self.last_val = (float("nan"), float("nan"))       # test accuracy and loss at the last evaluation
        self.last_valid = (float("nan"), float("nan"))     # the same on the validation split (data.val_frac)
        self.spread = (float("nan"), float("nan"))
        self.built = True

    def _header(self) -> dict:
        cfg = self.cfg
        return {"config": to_dict(cfg), "versions": _versions(), "git_sha": _git_sha(), "world_size": self.world,
                "device": str(self.dev), "algo": cfg.algo, "elastic": cfg.dist.elastic,
                "controller": comm.controller(), "outer_steps": self.K, "inner_steps_per_outer": self.L,
                "batches_per_pass": self.nb, "params": self.n_params, "resumed_from": self.resumed_from}

    def _open_log(self, start_step: int) -> None:
        """Rank 0's logger (a no-op elsewhere); reopened after an elastic reset, dropping
        what a replayed stretch had logged."""
        if self.log is not None:
            self.log.close()
        self.log = RunLogger(self.run_dir, enabled=self.rank == 0, tensorboard=self.cfg.run.tensorboard,
                             progress=self.cfg.run.progress, total=self.K, start_step=start_step)
        self.dog.on_fail = self.log.flush

    def start(self) -> bool:
        """Rank 0 resolves the run and any checkpoint, every rank builds its replica, then
        the first sync (or the resume). All ranks reach this. Returns False on a rank that
        has no replica yet: an elastic run resumed with more ranks than its checkpoint's
        (``_elastic_sync`` then starts it at the reference)."""
        try:
            return self._start_run()
        except BaseException:
            if self.created_dir and self.log is None:     # failed before the run began: leave no empty dir
                discard_if_empty(self.run_dir, self.created_dir)
            raise

    def _start_run(self) -> bool:
        rank, world = self.rank, self.world
        with self.dog.collective("start", 0):
            self.cfg, self.run_dir, resume_steps, self.ckpt_world, self.created_dir = _start(self.cfg, rank)
        cfg = self.cfg
        self.dog.attach(self.run_dir)
        resume_step, skipped = None, {}
        if resume_steps:
            with self.dog.collective("resume agreement", 0):
                resume_step, st, skipped = agree_on_checkpoint(self.run_dir, resume_steps, rank, self.ckpt_world)
            for s_, why in skipped.items():
                print(f"[rank {rank}] run.resume: skipping checkpoint step {s_}, which does not load here ({why})"
                      + (f"; resuming from step {resume_step}" if resume_step is not None else ""),
                      file=sys.stderr, flush=True)
            if resume_step is None:
                if skipped:
                    raise CheckpointError(f"run.resume: no checkpoint in {self.run_dir}/checkpoints loads on every "
                                          f"rank (this rank: {skipped[min(skipped)]})")
                raise RunError(f"run.resume: no checkpoint in {self.run_dir}/checkpoints loads on every rank "
                               f"(the failing ranks' messages above)")
        self.resumed_from = resume_step
        self.skipped_steps = [s_ for s_ in resume_steps if resume_step is not None and s_ > resume_step]
        if resume_step is None:
            self._build(rank, world, init_bcast=True)
        elif rank >= self.ckpt_world:
            return False
        else:
            self._build(st.get("replica", rank), st.get("world0", self.ckpt_world), init_bcast=False)
            if st.get("world") != self.ckpt_world or st.get("params") != self.n_params or st.get("algo") != cfg.algo:
                raise RunError(f"run.resume: checkpoint step {resume_step} is for {st.get('algo')} on {st.get('world')} "
                               f"ranks with {st.get('params')} parameters; this run is {cfg.algo} on {world} ranks "
                               f"with {self.n_params}")
            self.load_state(st)
            comm.load_stats(st["comm"])
            self.wall_before = st["wall"]
            self.eval_wall = st.get("eval_wall", 0.0)
        header = self._header()

        # Only now, with the config and any checkpoint accepted, touch the run directory's files.
        self._open_log(resume_step or 0)
        log = self.log
        if rank == 0:
            (self.run_dir / ("run.json" if resume_step is None else f"run-resume-{resume_step}.json")).write_text(
                json.dumps(header, indent=2))
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            log.info(f"parle_hvd: {cfg.algo}, {world} rank(s) [{comm.controller()}{', elastic' if self.elastic else ''}, "
                     f"{self.dev}], {self.K} outer steps of {self.L} inner steps, {self.nb} batches/pass, "
                     f"run dir {self.run_dir}")
            log.info(f"versions {header['versions']} git {header['git_sha'][:12]}")
            log.text("run", json.dumps(header, indent=2))

        if resume_step is not None:
            if rank == 0:
                for s_ in self.skipped_steps:
                    where = checkpoint.set_aside(self.run_dir, s_)
                    log.info(f"run.resume: checkpoint step {s_} does not load on every rank; skipped, moved to {where}")
                checkpoint.discard_after(self.run_dir, resume_step)
                log.info(f"resumed from checkpoint step {resume_step}"
                         + (f" (written by {self.ckpt_world} ranks)" if self.ckpt_world != world else ""))
            if self.elastic is not None and self.ckpt_world > world and self.algo.ref_is_mean:
                self._reform_reference([True] * world)      # all ranks reach this: the dropped replicas leave the mean
        elif self.algo.syncs:
            # The first reference, and rank 0's schedule for step 1. All ranks reach this.
            with self.dog.collective("first sync", 0):
                self.sched, _ = sync(self.model_t, self.ref_t, self.ex, self.schedule(1) if rank == 0 else None,
                                     {c: 0 for c in SLOT})
            self.dist_prev = replica_distance(self.model, self.ref)
            self.algo.after_sync(self.model_t, self.ref_t)
        else:
            self.sched = self.schedule(1)
        self.t_start = time.monotonic()
        return True

    # ----------------------------------------------------------------------- state
    def wall(self) -> float:
        return self.wall_before + (time.monotonic() - self.t_start)

    def state_dict(self) -> dict:
        """This rank's whole state after outer step ``self.k``: a checkpoint file's content,
        or (elastic mode) a commit. Tensors are the live ones: copy before keeping."""
        return {"step": self.k, "world": self.world, "params": self.n_params, "algo": self.cfg.algo,
                "replica": self.replica_id, "world0": self.world0,
                "model": self.model.state_dict(), "ref": self.ref.state_dict(), "algo_state": self.algo.state_dict(),
                "sampler": self.sampler.state_dict(), "aug_gen": self.aug_gen.get_state(),
                "rng_torch": torch.get_rng_state(), "rng_py": random.getstate(), "rng_np": np.random.get_state(),
                "rng_cuda": torch.cuda.get_rng_state() if self.dev.type == "cuda" else None,
                "comm": comm.stats().as_dict(), "sched": list(self.sched), "dist_prev": self.dist_prev,
                "wall": self.wall(), "eval_wall": self.eval_wall, "evals": self.evals, "samples": self.samples,
                "last_val": list(self.last_val), "last_valid": list(self.last_valid), "spread": list(self.spread),
                "ref_n": self.ref_n,
                "config": to_dict(self.cfg)}

    def load_state(self, st: dict) -> None:
        """Back to the state ``st`` (a checkpoint or a commit) describes; counters of time
        and traffic stay as they are (the caller decides)."""
        self.model.load_state_dict(st["model"])
        self.ref.load_state_dict(st["ref"])
        self.algo.load_state_dict(st["algo_state"])
        self.sampler.load_state_dict(st["sampler"])
        self.aug_gen.set_state(st["aug_gen"])
        torch.set_rng_state(st["rng_torch"])
        random.setstate(st["rng_py"])
        np.random.set_state(st["rng_np"])
        if self.dev.type == "cuda" and st.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(st["rng_cuda"])
        self.k, self.sched, self.dist_prev = st["step"], tuple(st["sched"]), st["dist_prev"]
        self.evals, self.samples, self.last_val = st["evals"], st["samples"], tuple(st["last_val"])
        self.spread = tuple(st.get("spread", self.spread))
        self.last_valid = tuple(st.get("last_valid", self.last_valid))
        self.ref_n = st.get("ref_n", st.get("world", self.world))

    def save_ckpt(self, k: int, *, last: bool) -> None:
        """Write this rank's checkpoint of step ``k``. A failure must reach every rank, or the
        others would wait in the next collective until dist.timeout: after a ``last``
        checkpoint (the run's end, or a stop) no collective follows and the error is raised
        at once; otherwise it rides in this rank's slot row of the next outer step's sync,
        where every rank sees it and stops (``_raise_ckpt_failure``)."""
        try:
            checkpoint.save(self.run_dir, k, self.rank, self.state_dict(), self.cfg.run.keep)
        except OSError as e:
            done = checkpoint.latest_complete(self.run_dir, self.world)
            self.ckpt_error = (f"run.dir: rank {self.rank} cannot write checkpoint step {k} in "
                               f"{self.run_dir}/checkpoints ({e.strerror or e}); the last complete "
                               f"checkpoint (step {done}) is kept")
            if last:
                raise CheckpointError(self.ckpt_error) from None

    def _raise_ckpt_failure(self, bad: list) -> None:
        """Every rank, after a sync whose slot rows say a checkpoint write failed: the rank
        that failed raises its own message (printed by that rank); the others a RunError
        (printed by rank 0) naming it."""
        if self.log is not None:
            self.log.flush()
        if self.ckpt_error is not None:
            raise CheckpointError(self.ckpt_error)
        done = checkpoint.latest_complete(self.run_dir, self.world)
        raise RunError(f"run.dir: rank(s) {bad} could not write their checkpoint (their message above); stopped "
                       f"after outer step {self.k}. The last complete checkpoint (step {done}) is kept in "
                       f"{self.run_dir}/checkpoints")

    # ----------------------------------------------------------------------- elastic mode
    def _commit(self) -> None:
        """Horovod's State.save: keep a copy of this rank's state in host memory (not on
        the GPU, where it would double the model's footprint)."""
        if self.built:
            t = time.monotonic()
            self.committed = _host_copy(self.state_dict())
            self.commit_seconds += time.monotonic() - t

    def _restore(self) -> None:
        """Horovod's State.restore, after a rank failed: back to the last commit."""
        if self.committed is not None:
            self.load_state(copy.deepcopy(self.committed))   # a copy: optimizers may alias what they load
            self.restored = True

    def _on_reset(self) -> None:
        """Horovod re-formed the world (a rank left or joined): new ranks, new sizes."""
        old = self.world
        self.rank, self.world = comm.rank(), comm.size()
        self.stop.rank = self.rank
        self.dog.reset(self.rank, self.world)
        if self.cfg.dist.threads == 0:
            comm.set_threads_per_rank()
        if not self.built:
            return
        self.ex = Exchange(self.world, self.rank, self.dtype)
        self.algo.world, self.algo.rank = self.world, self.rank
        self._open_log(self.k)
        why = "a rank failed; back to the last commit" if self.restored else "hosts changed"
        self.log.info(f"elastic: {why}: {old} -> {self.world} rank(s) after outer step {self.k}")
        self.events.append({"step": self.k, "from": old, "to": self.world, "why": why})
        if self.removal_only and not self.restored and self.world < self.ref_n and self.algo.ref_is_mean:
            # no state sync follows a removal alone: every rank here holds a replica
            self._reform_reference([True] * self.world)     # all ranks reach this
        self.restored = self.removal_only = False

    def _reform_reference(self, members: list) -> None:
        """Elastic mode, after replicas were lost: the reference becomes the mean of the
        replicas that remain (``members[r]``: rank r holds one), not the committed reference
        that still averages in the lost ones. One fused allreduce: members send their weights
        and BatchNorm buffers, the other ranks (joiners, not yet started) zeros. All ranks reach this."""
        mine, n = members[self.rank], sum(members)
        dump = os.environ.get("PARLE_HVD_DUMP_REFORM")        # testing hook (tests/test_elastic.py)
        before = [t.clone() for t in self.ref_t] if dump else None
        with torch.no_grad():
            for r_, m in zip(self.ref_t, self.model_t):
                r_.copy_(m) if mine else r_.zero_()
        with self.dog.collective("elastic reference re-formed", self.k):
            comm.allreduce_sum_(self.ref_t, name="elastic.reform")     # all ranks reach this
        with torch.no_grad():
            for r_ in self.ref_t:
                r_.div_(n)
        self.ref_n = n
        if mine:
            self.dist_prev = replica_distance(self.model, self.ref)
        if self.log is not None:
            self.log.info(f"elastic: the reference re-formed from the {n} remaining replica(s) at outer step {self.k}")
        if dump:
            torch.save({"ref": [t.clone() for t in self.ref_t], "model": [t.clone() for t in self.model_t],
                        "before": before, "member": mine, "step": self.k, "replica": self.replica_id},
                       Path(dump) / f"reform-rank{self.rank}-step{self.k}.pt")

    def _elastic_sync(self) -> None:
        """Horovod's State.sync, at the start and after every reset but a removal alone.
        Replicas that were committed at the newest step keep their own state; the lowest
        such rank (the root) sends the run's state and the reference; every other rank (a
        new one, or one left behind) builds a replica and starts it at the reference. The
        first time, no rank holds a replica and this is ``start()``. All ranks reach this."""
        rank, world = self.rank, self.world
        rows = torch.zeros(world, 3, dtype=torch.float64)
        if self.committed is not None:
            rows[rank] = torch.tensor([1.0, float(self.replica_id), float(self.k)], dtype=torch.float64)
        with self.dog.collective("elastic members", self.k if self.built else 0):
            comm.allreduce_sum_([rows], name="elastic.members")       # all ranks reach this
        holders = [r for r in range(world) if rows[r, 0] > 0]
        if not holders:
            self.start()
            self._commit()
            if self.ckpt_world < world:       # resumed with more ranks than wrote the checkpoint
                self._elastic_sync()          # all ranks reach this: the others start at the reference
            return
        k_new = max(int(rows[r, 2]) for r in holders)
        keep = [r for r in holders if int(rows[r, 2]) == k_new]
        root, mine = keep[0], rank in keep
        msg = None
        if rank == root:
            msg = {"cfg": self.cfg, "run_dir": str(self.run_dir), "world0": self.world0, "k": self.k,
                   "sched": self.sched, "evals": self.evals, "samples": self.samples, "last_val": self.last_val,
                   "last_valid": self.last_valid,
                   "spread": self.spread, "wall": self.wall(), "eval_wall": self.eval_wall,
                   "comm": comm.stats().as_dict(), "events": self.events,
                   "resumed_from": self.resumed_from, "ref_n": self.ref_n}
        with self.dog.collective("elastic run state", k_new):
            msg = comm.broadcast_object(msg, root=root, name="elastic.run")   # all ranks reach this
        taken = {int(rows[r, 1]) for r in keep}
        new = [r for r in range(world) if r not in keep]
        free = [i for i in range(world + len(taken)) if i not in taken][:len(new)]
        if not mine:
            self.cfg, self.run_dir = msg["cfg"], Path(msg["run_dir"])
            self.dog.attach(self.run_dir)
            self._build(free[new.index(rank)], msg["world0"], init_bcast=False)
        shared = self.algo.shared_tensors()
        with self.dog.collective("elastic reference", k_new):
            comm.broadcast_(self.ref_t + shared, root=root, name="elastic.ref")   # all ranks reach this
        if self.algo.ref_is_mean and len(keep) < msg["ref_n"]:
            # replicas were lost: the reference is re-formed from the ones kept (before any
            # new replica starts at it). Every rank sees the same rows and msg: all reach this.
            self._reform_reference([r in keep for r in range(world)])
        if not mine:
            with torch.no_grad():
                for m, r in zip(self.model_t, self.ref_t):
                    m.copy_(r)                      # the new replica starts at the current reference
            self.k, self.sched, self.evals, self.samples = msg["k"], tuple(msg["sched"]), msg["evals"], msg["samples"]
            self.last_val, self.spread, self.resumed_from = tuple(msg["last_val"]), tuple(msg["spread"]), msg["resumed_from"]
            self.last_valid = tuple(msg["last_valid"])
            self.wall_before, self.t_start = msg["wall"], time.monotonic()
            self.eval_wall = msg["eval_wall"]
            self.dist_prev = replica_distance(self.model, self.ref)
            comm.load_stats(msg["comm"])
            self.events = list(msg["events"])
            print(f"[rank {rank}] elastic: joined at outer step {self.k} as replica {self.replica_id}, "
                  f"starting at the reference (||x - xbar|| = {self.dist_prev:.3g})", file=sys.stderr, flush=True)
            self._open_log(self.k)
        if new:
            self.events.append({"step": self.k, "world": world, "kept_ranks": keep, "joined_ranks": new,
                                "joined_replicas": free})
        self.log.info(f"elastic: {world} rank(s) at outer step {self.k}: {len(keep)} replica(s) kept, "
                      f"{len(new)} started at the reference (replica ids {free})")
        self._commit()

    # ----------------------------------------------------------------------- the loop
    def loop(self) -> dict:
        cfg, rank, world = self.cfg, self.rank, self.world
        model, ref, algo, sampler, ds = self.model, self.ref, self.algo, self.sampler, self.ds
        dtype, dev, log, dog = self.dtype, self.dev, self.log, self.dog
        K, L, nb = self.K, self.L, self.nb
        model_t, ref_t, ref_params = self.model_t, self.ref_t, self.ref_params
        model.train()
        stopped_at = None
        for k in range(self.k + 1, K + 1):
            t_step = time.monotonic()
            gk, rk, lr = self.sched                     # rank 0's values, received at the last sync
            algo.begin_outer()
            losses = []
            for _ in range(L):                          # inner steps: no communication (but dpsgd's)
                b = sampler.next()
                xb = ds.train_x[b]
                if cfg.data.augment:
                    xb = augment_batch(xb, self.aug_gen)
                out = model(to_input(xb.to(dev, non_blocking=True), ds.mean, ds.std, dtype))
                loss = F.cross_entropy(out, ds.train_y[b].to(dev, non_blocking=True))
                model.zero_grad(set_to_none=True)
                loss.backward()
                algo.inner_step(gk=gk, rk=rk, lr=lr, xbar=ref_params)
                losses.append(loss.detach())
            algo.end_outer(ref_params, rk=rk, lr=lr)    # parle: the elastic pull toward the reference
            if _injected("PARLE_HVD_INJECT_NAN", rank, k):
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))
            lt = torch.stack(losses).double()
            finite = bool(torch.isfinite(lt).all()) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
            commit = self.elastic is not None and (k % cfg.dist.elastic_commit_every == 0 or k == K)
            slot = {"loss": float(lt.mean()), "loss_max": float(lt.max()), "distance": self.dist_prev,
                    "nonfinite": float(not finite),
                    "stop": float(self.stop.requested is not None or _injected("PARLE_HVD_INJECT_STOP", rank, k)),
                    "ckpt": float(self.ckpt_error is not None),
                    # the coordinator's news of hosts leaving or joining, acted on at this commit
                    "hosts": float(self.elastic.host_update_pending()) if commit and rank == 0 else 0.0}
            if algo.syncs:
                # One allreduce: the new reference, rank 0's schedule for step k+1, every replica's slot.
                with dog.collective("sync", k):
                    self.sched, rows = sync(model_t, ref_t, self.ex, self.schedule(k + 1) if rank == 0 else None, slot)
                self.ref_n = world
                self.dist_prev = replica_distance(model, ref)
                algo.after_sync(model_t, ref_t)
            else:
                # Every rank computes the (deterministic) schedule; one small allreduce of the slots.
                self.sched = self.schedule(k + 1)
                with dog.collective("slots", k):
                    rows = exchange_slots(slot, rank, world)
            self.k = k
            self.samples += world * L * cfg.train.batch_size

            if rank == 0 and (k % self.log_every_steps == 0 or k == K):
                dt = time.monotonic() - t_step
                cs = comm.stats()
                sc = {"train/loss": rows[:, 0].mean(), "train/loss_max": rows[:, 0].max(),
                      "train/loss_max_inner": rows[:, 1].max(), "parle/lr": lr,
                      "comm/bytes": cs.bytes, "comm/allreduce_calls": cs.allreduce_calls,
                      "perf/samples_per_sec": world * L * cfg.train.batch_size / max(dt, 1e-9),
                      "train/passes": k * L / nb}
                if self.elastic:
                    sc["dist/world_size"] = world
                if "gamma" in algo.couplings:
                    sc.update({"parle/gamma": 1.0 / gk if gk > 0 else None, "parle/gamma_inv": gk})
                if "rho" in algo.couplings:
                    sc.update({"parle/rho": 1.0 / rk if rk > 0 else None, "parle/rho_inv": rk})
                if algo.syncs:
                    sc.update({"parle/replica_distance": rows[:, 2].mean(),
                               "parle/replica_distance_max": rows[:, 2].max()})
                log.scalars(k, sc)
            if bool(rows[:, 3].any()):            # every rank sees the same rows: all stop here, together
                bad = [i for i in range(len(rows)) if rows[i, 3] > 0]
                last = checkpoint.latest_complete(self.run_dir, world)
                log.flush()
                raise DivergenceError(f"non-finite loss or weights on rank(s) {bad} at outer step {k}; stopped. "
                                      f"The last complete checkpoint (step {last}) is kept in {self.run_dir}/checkpoints")
            if bool(rows[:, 6].any()):           # a rank could not write the last checkpoint: all stop here
                self._raise_ckpt_failure([i for i in range(len(rows)) if rows[i, 6] > 0])
            if bool(rows[:, 4].any()):
                stopped_at = k

            # A stop still evaluates at an evaluation step, so that an interrupted and resumed
            # run makes the same evaluations (and the same summary) as an uninterrupted one.
            if k % self.eval_every_steps == 0 or k == K:
                t_eval = time.monotonic()
                with dog.collective("evaluation", k):
                    algo.form_reference(model_t, ref_t)     # all ranks reach this (a no-op for syncing algorithms)
                    recompute_bn(ref, ds, cfg.eval.bn_batches, cfg.train.batch_size, cfg.train.seed, k, dtype, dev)
                    acc, vloss, drows, valid = evaluate(ref, ds, rank, world, cfg.eval.batch_size, dtype, dev,
                                                        [self.dist_prev])
                if algo.syncs:
                    self.spread = (float(drows.mean()), float(drows.max()))   # ||x_a - xbar|| now, every replica
                self.evals += 1
                self.eval_wall += time.monotonic() - t_eval
                self.last_val = (acc, vloss)
                sc = {"val/accuracy": acc, "val/loss": vloss, "val/error": 1 - acc,   # val/*: the test set
                      "comm/allreduce_calls": comm.stats().allreduce_calls, "comm/bytes": comm.stats().bytes,
                      "train/passes": k * L / nb, "train/wall_seconds": self.wall(),
                      "train/eval_seconds": self.eval_wall}
                if valid is not None:
                    self.last_valid = valid
                    sc.update({"valid/accuracy": valid[0], "valid/loss": valid[1], "valid/error": 1 - valid[0]})
                log.scalars(k, sc)
                log.info(f"step {k}/{K} pass {k * L / nb:.2f}: "
                         + (f"valid acc {valid[0]:.4f}, " if valid is not None else "")
                         + f"test acc {acc:.4f} loss {vloss:.4f}, "
                         f"train loss {float(rows[:, 0].mean()):.4f}, lr {lr:.3g}"
                         + (f" gamma_inv {gk:.3g}" if "gamma" in algo.couplings else "")
                         + (f" rho_inv {rk:.3g}" if "rho" in algo.couplings else "")
                         + (f", {world} ranks" if self.elastic else ""))
                model.train()
            log.progress(k, f"loss {float(rows[:, 0].mean()):.3f} val {self.last_val[0]:.4f}")

            if (cfg.run.ckpt_every and k % cfg.run.ckpt_every == 0) or k == K or stopped_at is not None:
                self.save_ckpt(k, last=k == K or stopped_at is not None)
            if stopped_at is not None and k < K:     # a stop at K simply finishes
                who = [i for i in range(len(rows)) if rows[i, 4] > 0]
                log.info(f"stopped after outer step {k} on a signal to rank(s) {who}; checkpoint written; "
                         f"resume with run.resume=true run.dir={self.run_dir}")
                log.close()
                return {"stopped_at": k, "run_dir": str(self.run_dir)}
            if commit:
                # Commit, then leave for a re-formed world if the coordinator heard of host
                # changes (rows are the same on every rank: all leave at this step). Horovod
                # runs no state sync after a removal alone (update == 1): _on_reset then
                # re-forms the reference itself.
                update = int(rows[:, 5].sum())
                self.removal_only = update == 1
                self.elastic.commit(update)
        return self.finish()

    def finish(self) -> dict:
        cfg, log = self.cfg, self.log
        wall = self.wall()
        cs = comm.stats()
        K, L = self.K, self.L
        # val_accuracy/val_loss: the test set (the historical names); valid_*: the held-out
        # validation split of the training set (data.val_frac; NaN without one)
        summary = {"val_accuracy": self.last_val[0], "val_loss": self.last_val[1],
                   "test_accuracy": self.last_val[0], "test_loss": self.last_val[1],
                   "valid_accuracy": self.last_valid[0], "valid_loss": self.last_valid[1], "wall_seconds": wall,
                   "eval_seconds": self.eval_wall, "outer_steps": K, "inner_steps": K * L, "sync_period": L,
                   "passes": K * L / self.nb,
                   "evaluations": self.evals, "samples_seen": self.samples, "allreduce_calls": cs.allreduce_calls,
                   "broadcast_calls": cs.broadcast_calls, "bytes_communicated": cs.bytes,
                   "allreduce_bytes": cs.allreduce_bytes, "broadcast_bytes": cs.broadcast_bytes,
                   "final_replica_distance": self.spread[0], "final_replica_distance_max": self.spread[1],
                   "params": self.n_params, "world_size": self.world, "algo": cfg.algo,
                   "controller": comm.controller(), "device": str(self.dev), "resumed_from": self.resumed_from,
                   "elastic": cfg.dist.elastic, "elastic_events": self.events,
                   "elastic_commit_seconds": self.commit_seconds, "config": to_dict(cfg)}
        if self.rank == 0:
            try:   # both written whole or not at all
                checkpoint.atomic_save(self.ref.state_dict(), self.run_dir / "final.pt")
                checkpoint.atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            except OSError as e:
                raise CheckpointError(f"run.dir: cannot write final.pt/summary.json in {self.run_dir} "
                                      f"({e.strerror or e}); the last complete checkpoint is kept") from None
            log.info(f"done: val accuracy {self.last_val[0]:.4f}, {wall:.1f} s, {cs.allreduce_calls} allreduces, "
                     f"{cs.bytes / 1e6:.2f} MB; {self.run_dir}/summary.json")
        log.close()
        return summary


def train(cfg: Config) -> dict:
    """Run ``cfg`` on this rank; every rank calls this. Returns the summary (rank 0 also
    writes it to ``<run.dir>/summary.json``)."""
    return Trainer(cfg).run()
