"""The training loop: one MPI rank = one replica.

    horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
    mpirun -np 4 python train.py --config configs/fashion_parle.yaml parle.sync_period=50
    launch/elastic.sh ...        # Horovod's elastic mode: membership.py

Read ``Trainer.loop`` top to bottom: K outer steps of [L inner steps, outer update, one
sync], with evaluations and checkpoints between syncs. Before it, ``start`` (rank 0
resolves the run and any checkpoint, rundir.py; every rank builds its replica; the first
sync or the resume). What travels in the sync is exchange.py's; evaluation is
evaluation.py's; elastic membership is membership.py's.

A run of K outer steps with E evaluations makes exactly K + 1 + E allreduces (the +1 forms
the first reference from the independently initialised replicas; an evaluation is one
allreduce of float64 sums).

With ``parle.overlap`` the sync of step k is started, not waited for: step k+1's inner
loop runs while it travels, and the wait comes just before step k+1's outer update, the
first use of the reference. The update is PARLE.md's exactly (its xbar is formed at the
start of the outer step and first used at its end); what comes one step later is the
reading of the slot rows (a stop or a divergence is acted on after step k+1). A step that
evaluates, checkpoints or ends the run waits for its own sync at once ("drains"), so the
reference evaluated and saved, and a resume, are exactly those of the blocking loop.
docs/algorithm.md, "Overlapped sync" and "Balanced inner steps".
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from . import checkpoint, comm
from .algorithms import ALGORITHMS
from .checkpoint import CheckpointError
from .config import Config, to_dict
from .data import (ReplicaSampler, augment_batch, common_nb, hold_out, load_dataset, replica_indices, to_device,
                   to_input, _gen)
from .evaluation import evaluate, recompute_bn
from .exchange import SLOT, Exchange, Plan, exchange_slots, outer_schedule, replica_distance, sync, sync_start
from .parle import balance_steps
from .logger import RunLogger
from .membership import Membership
from .models import build_model, sync_tensors
from .targets import Objective, TargetError, build_user_model, check_loss, load_user_dataset, objective
from .rundir import RunError, agree_on_checkpoint, discard_if_empty, git_sha, start_run, versions
from .watchdog import StopSignal, Watchdog

__all__ = ["Trainer", "train", "RunError", "DivergenceError"]


class DivergenceError(RuntimeError):
    """Non-finite loss or weights; one line, exit 3, the last complete checkpoint kept."""


def _injected(hook: str, rank: int, step: int) -> bool:
    """Testing hooks (tests/test_robustness.py), "<rank>:<outer step>":
    PARLE_HVD_INJECT_NAN poisons that replica's weights after that outer step's inner loop;
    PARLE_HVD_INJECT_STOP acts as if a SIGTERM reached that rank during that outer step."""
    return os.environ.get(hook, "") == f"{rank}:{step}"


def _fake_step_seconds(rank: int) -> Optional[float]:
    """Testing hook (tests/test_overlap.py): PARLE_HVD_FAKE_STEP_SECONDS="s0,s1,..." reports
    rank r's seconds per inner step as s_r, so that parle.balance's assignments are
    deterministic and a resumed run can be compared with an uninterrupted one."""
    v = os.environ.get("PARLE_HVD_FAKE_STEP_SECONDS")
    return float(v.split(",")[rank]) if v else None


@dataclass
class InFlight:
    """The sync of outer step ``step``: started (``pending``; None for algorithms without a
    sync, whose slot rows are already in ``rows``), not yet read."""
    step: int
    plan: Plan
    t_start: float              # when the step began
    t_sent: float               # when its sync was started
    pending: Optional[comm.Pending] = None
    rows: Optional[torch.Tensor] = None


class InnerTimer:
    """Seconds of one replica's inner loop, for parle.balance. On the CPU, host time. On a
    GPU, CUDA events recorded on the stream the loop runs on, and a wait for that stream's
    work alone: with parle.overlap the previous sync's allreduce is queued on the device too
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
        """The loop's seconds; ``wait`` (a context manager, the watchdog's) guards the wait
        for the stream, so that a device held up by a dead peer is named, not left to hang."""
        with wait if wait is not None else contextlib.nullcontext():
            if self.start is None:
                return time.monotonic() - self.t0
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()                  # this stream's work only, never the collective's
        return self.start.elapsed_time(end) / 1000.0


def _np_rng_state() -> dict:
    """numpy's global RNG state as tensors and numbers, so that a checkpoint loads with
    ``torch.load(weights_only=True)`` (no pickled numpy objects)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _np_set_rng_state(st) -> None:
    if isinstance(st, dict):
        st = (st["name"], st["key"].numpy().astype(np.uint32), st["pos"], st["has_gauss"], st["gauss"])
    np.random.set_state(st)          # (a tuple: a checkpoint from before weights-only files)


def pick_device(want: str, share: bool = False) -> torch.device:
    """One GPU per rank (its local rank), or the CPU; with ``share`` (dist.share_device)
    the local ranks take the GPUs round-robin."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RunError("dist.device: cuda requested but torch.cuda.is_available() is False")
    n = torch.cuda.device_count()
    if comm.local_size() > n and not share:
        raise RunError(f"dist.device: {comm.local_size()} ranks on this host but {n} GPU(s); "
                       f"start one rank per GPU (or set dist.share_device=true to share them, with Gloo)")
    i = comm.local_rank() % n
    torch.cuda.set_device(i)
    return torch.device("cuda", i)


class Trainer:
    """One rank's run: its replica, the reference, and the loop.

    Without elastic mode ``run()`` is ``start()`` then ``loop()``. In elastic mode
    (``dist.elastic``) Horovod's ``elastic.run`` drives the same ``loop()`` through
    ``Membership`` (membership.py), whose ``sync`` takes the place of ``start()``."""

    def __init__(self, cfg: Config):
        try:
            comm.init(cfg.dist.backend, set_threads=cfg.dist.threads == 0, timeout=cfg.dist.timeout,
                      engine=cfg.dist.engine, gpu_backend="gloo" if cfg.dist.share_device else "nccl")
        except comm.EngineError as e:
            raise RunError(str(e)) from None
        if cfg.dist.threads:
            torch.set_num_threads(cfg.dist.threads)
        if cfg.run.deterministic:         # a GPU's kernels may pick algorithms by timing, or add atomically
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.cfg = cfg
        self.rank, self.world = comm.rank(), comm.size()
        self.stop = StopSignal(self.rank)
        self.stop.install()
        self.dog = Watchdog(cfg.dist.timeout, self.rank, self.world)
        self.member: Optional[Membership] = None    # elastic mode only
        self.ckpt_error = None       # this rank's failed checkpoint write, reported at the next sync
        self.created_dir = None      # what rank 0 made for the run directory in this start (removed if the start fails)
        self.log = None
        self.ds = None
        self.built = False
        self.resumed_from = None
        self.ckpt_world = self.world
        self.t_start = time.monotonic()
        self.obj = self._resolve_targets()

    def _resolve_targets(self) -> Objective:
        """The loss and metric, and any model, dataset, loss or metric named by import path
        (targets.py), imported and tried once here: on every rank alike, before any
        collective, so that a bad one ends every rank with the same one line (exit 2)."""
        cfg = self.cfg
        try:
            obj = objective(cfg.train.loss, cfg.eval.metric)
            if cfg.model.target or cfg.data.target or not obj.builtin_loss or obj.metric_fn is not None:
                ds = self._load_data()
                rng = torch.get_rng_state()
                key = "model.target" if cfg.model.target else "model.name"
                try:
                    model = self._new_model(ds).to(dtype=getattr(torch, cfg.model.dtype))
                except TargetError:
                    raise
                except Exception as e:         # a built-in model given data.target's examples, say
                    raise TargetError(f"model.name: {cfg.model.name} cannot take the data's inputs of shape "
                                      f"{tuple(ds.shape)} ({type(e).__name__}: {e}); set model.target") from None
                check_loss(obj, model, to_input(ds.train_x[:2], ds.mean, ds.std, getattr(torch, cfg.model.dtype)),
                           ds.train_y[:2], cfg.train.loss, key)
                torch.set_rng_state(rng)       # the trial leaves the run's random streams as they were
        except TargetError as e:
            raise RunError(str(e)) from None
        return obj

    def _load_data(self):
        """The dataset (built in, or data.target's), with its limits and validation split;
        once per rank."""
        cfg = self.cfg
        if self.ds is None:
            if cfg.data.target:
                ds = load_user_dataset(cfg.data.target, cfg.data.kwargs)
                if cfg.data.train_limit:
                    ds.train_x, ds.train_y = ds.train_x[:cfg.data.train_limit], ds.train_y[:cfg.data.train_limit]
                if cfg.data.test_limit:
                    ds.test_x, ds.test_y = ds.test_x[:cfg.data.test_limit], ds.test_y[:cfg.data.test_limit]
            else:
                ds = load_dataset(cfg.data.name, cfg.data.dir, cfg.data.train_limit, cfg.data.test_limit,
                                  cfg=cfg.data, seed=cfg.train.seed)
            if cfg.data.val_frac:       # the same split on every rank: it depends on the seed only
                ds = hold_out(ds, cfg.data.val_frac, seed=cfg.train.seed)
            self.ds = ds
        return self.ds

    def _new_model(self, ds) -> nn.Module:
        """model.target's module, or the built-in model.name sized to the dataset."""
        m = self.cfg.model
        if m.target:
            return build_user_model(m.target, m.kwargs)
        return build_model(m.name, num_classes=ds.num_classes, in_channels=ds.shape[0], image_size=ds.shape[1],
                           dropout=m.dropout, depth=m.depth, width=m.width)

    def run(self) -> dict:
        cfg = self.cfg
        if not cfg.dist.elastic:
            if cfg.dist.expect_ranks and cfg.dist.expect_ranks != self.world:
                raise RunError(f"dist.expect_ranks: this config is meant for {cfg.dist.expect_ranks} ranks, "
                               f"launched with {self.world} (override dist.expect_ranks=0 to run anyway)")
            self.start()
            return self.loop()
        if comm.engine() == "torch":
            return self._run_torchrun_elastic()
        if not comm.elastic_launched():
            raise RunError("dist.elastic: start the job with horovodrun's elastic mode (launch/elastic.sh: "
                           "--min-np, --max-np, --host-discovery-script)")
        self.member = Membership(self)
        return self.member.run()

    def _run_torchrun_elastic(self) -> dict:
        """torchrun's elastic agent restarts every worker after a failure or a change of
        nodes; a restart resumes from the newest complete checkpoint in the run directory
        (which, with run.dir unset, is named after the rendezvous id, the same in every
        restart), whatever number of ranks wrote it."""
        cfg = self.cfg
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id is None:
            raise RunError("dist.elastic with dist.engine=torch: start the job with torchrun "
                           "(launch/torchrun.sh: --nnodes=MIN:MAX --max-restarts=N)")
        if not cfg.run.dir:
            cfg.run.dir = str(Path("runs") / f"{cfg.run.name}-torchrun-{run_id}")
        if comm.restart_count() and checkpoint.latest_complete_any(Path(cfg.run.dir)) is not None:
            cfg.run.resume = True          # rank 0's view decides (start_run sends its config)
        self.member = Membership(self, restarts=True)
        return self.member.run()

    # ----------------------------------------------------------------------- building
    def build(self, replica_id: int, world0: int, *, init_bcast: bool) -> None:
        """This rank's replica: data, sampler, model, algorithm, and the loop's counters.
        ``replica_id`` names the replica (its seed, its data order and window): the rank,
        except for a replica that joins an elastic run. ``world0`` is the world size the
        data windows were cut for."""
        cfg, rank, world = self.cfg, self.rank, self.world
        P, O = cfg.parle, cfg.optim
        self.dtype = dtype = getattr(torch, cfg.model.dtype)
        self.dev = dev = pick_device(cfg.dist.device, cfg.dist.share_device)
        algo_cls = ALGORITHMS[cfg.algo]
        self.replica_id, self.world0 = replica_id, world0

        # Data: every replica holds the whole dataset in memory (uint8) and its own window/order;
        # data-parallel SGD gives each rank a disjoint shard instead.
        self.ds = ds = to_device(self._load_data(), dev)   # a GPU rank: the data moves once, batches are made there
        # dpsgd: frac = 1/n cuts disjoint shards that cover the data (data.window_bounds)
        split, frac = (("frac", 1.0 / world0) if algo_cls.shard_data and world0 > 1 else (cfg.data.split, cfg.data.frac))
        idx = replica_indices(len(ds.train_x), rank=replica_id, world=world0, split=split, frac=frac, seed=cfg.train.seed)
        # the same number of batches per pass on every replica, whatever its window's size
        nb = common_nb(len(ds.train_x), world=world0, split=split, frac=frac, batch_size=cfg.train.batch_size)
        self.sampler = ReplicaSampler(idx, cfg.train.batch_size, seed=cfg.train.seed, rank=replica_id, nb=nb,
                                      device=ds.train_x.device)
        self.nb = nb = self.sampler.nb

        # Replica: independent initialisation (seed + replica) unless asked to start from rank 0's.
        torch.manual_seed(cfg.train.seed + replica_id)
        random.seed(cfg.train.seed + replica_id)
        np.random.seed((cfg.train.seed + replica_id) % 2**32)
        self.model = self._new_model(ds).to(device=dev, dtype=dtype)
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
        self.aug_gen = _gen("augment", cfg.train.seed, replica_id, device=dev)
        self.n_params = sum(p.numel() for p in self.model.parameters())

        self.schedule = lambda k: outer_schedule(k, L=L, nb=nb, parle=P, optim=O, epochs=cfg.train.epochs)
        # overlap and balance are Parle's: its inner loop does not read the reference
        self.overlap = P.overlap and algo_cls.overlaps
        self.balance = P.balance == "time" and algo_cls.overlaps and world > 1

        # State carried across outer steps (and checkpoints).
        self.k, self.wall_before, self.evals, self.samples, self.dist_prev = 0, 0.0, 0, 0, 0.0
        self.eval_wall = 0.0         # seconds spent evaluating (in wall()): time to accuracy can leave it out
        self.plans: dict = {}        # outer step -> Plan, as received from rank 0 (or computed here without a sync)
        self.speeds = [0.0] * world  # every replica's seconds per inner step, smoothed (parle.balance)
        self.inflight: Optional[InFlight] = None
        self.last_rows = torch.zeros(world, len(SLOT), dtype=torch.float64)   # the newest slot rows received
        self.last_loss, self.loss_step = float("nan"), None   # the mean training loss of the newest rows received, and their step
        self.stop_ranks: set = set()  # ranks whose slot rows asked for a stop (with overlap they arrive a step early)
        self.overlapped_syncs = 0    # syncs waited for only in the next outer step (parle.overlap)
        self.ref_n = world           # how many replicas the current reference averages
        self.last_val = (float("nan"), float("nan"))       # test accuracy and loss at the last evaluation
        self.last_valid = (float("nan"), float("nan"))     # the same on the validation split (data.val_frac)
        self.spread = (float("nan"), float("nan"))
        self.built = True

    def _header(self) -> dict:
        cfg = self.cfg
        return {"config": to_dict(cfg), "versions": versions(), "git_sha": git_sha(), "world_size": self.world,
                "device": str(self.dev), "algo": cfg.algo, "elastic": cfg.dist.elastic,
                "engine": comm.engine(), "controller": comm.controller(), "outer_steps": self.K, "inner_steps_per_outer": self.L,
                "overlap": self.overlap, "balance": "time" if self.balance else "off",
                "batches_per_pass": self.nb, "params": self.n_params, "resumed_from": self.resumed_from}

    def open_log(self, start_step: int) -> None:
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
        (``Membership.sync`` then starts it at the reference)."""
        try:
            return self._start_run()
        except BaseException:
            if self.created_dir and self.log is None:     # failed before the run began: leave no empty dir
                discard_if_empty(self.run_dir, self.created_dir)
            raise

    def _start_run(self) -> bool:
        rank, world = self.rank, self.world
        with self.dog.collective("start", 0):
            self.cfg, self.run_dir, resume_steps, self.ckpt_world, self.created_dir = start_run(self.cfg, rank)
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
            self.build(rank, world, init_bcast=True)
        elif rank >= self.ckpt_world:
            return False
        else:
            self.build(st.get("replica", rank), st.get("world0", self.ckpt_world), init_bcast=False)
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
        self.open_log(resume_step or 0)
        log = self.log
        if rank == 0:
            (self.run_dir / ("run.json" if resume_step is None else f"run-resume-{resume_step}.json")).write_text(
                json.dumps(header, indent=2))
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            log.info(f"parle_hvd: {cfg.algo}, {world} rank(s) [{comm.engine()} {comm.controller()}{', elastic' if self.member else ''}, "
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
            if self.member is not None and self.ckpt_world > world and self.algo.ref_is_mean:
                self.member.reform_reference([True] * world)   # all ranks reach this: the dropped replicas leave the mean
        elif self.algo.syncs:
            # The first reference, and rank 0's plans for steps 1 and 2. All ranks reach this.
            with self.dog.collective("first sync", 0):
                plans, _ = sync(self.model_t, self.ref_t, self.ex, self._plans_after(0) if rank == 0 else None,
                                {c: 0 for c in SLOT})
            self.plans = {1 + i: p for i, p in enumerate(plans)}
            self.dist_prev = replica_distance(self.algo.anchor(), self.ref_params)
            self.algo.after_sync(self.model_t, self.ref_t)
        else:
            self.plans = {1: self._plan(1)}
        self.t_start = time.monotonic()
        return True

    # ----------------------------------------------------------------------- state
    def wall(self) -> float:
        return self.wall_before + (time.monotonic() - self.t_start)

    def run_state(self) -> dict:
        """The loop's counters, sent to a replica that joins (elastic mode)."""
        return {"k": self.k, "plans": self._plans_state(), "evals": self.evals, "samples": self.samples,
                "last_val": self.last_val, "last_valid": self.last_valid, "spread": self.spread,
                "wall": self.wall(), "eval_wall": self.eval_wall, "resumed_from": self.resumed_from,
                "ref_n": self.ref_n}

    def load_run_state(self, st: dict) -> None:
        """The counters ``run_state`` gave; the wall clock goes on from ``st["wall"]``."""
        self.k, self.evals, self.samples = st["k"], st["evals"], st["samples"]
        self._load_plans(st["plans"])
        self.last_val, self.last_valid, self.spread = tuple(st["last_val"]), tuple(st["last_valid"]), tuple(st["spread"])
        self.wall_before, self.eval_wall = st["wall"], st["eval_wall"]
        self.resumed_from, self.ref_n = st["resumed_from"], st["ref_n"]


    def state_dict(self) -> dict:
        """This rank's whole state after outer step ``self.k``: a checkpoint file's content,
        or (elastic mode) a commit. Tensors are the live ones: copy before keeping."""
        return {"step": self.k, "world": self.world, "params": self.n_params, "algo": self.cfg.algo,
                "replica": self.replica_id, "world0": self.world0,
                "model": self.model.state_dict(), "ref": self.ref.state_dict(), "algo_state": self.algo.state_dict(),
                "sampler": self.sampler.state_dict(), "aug_gen": self.aug_gen.get_state(),
                "rng_torch": torch.get_rng_state(), "rng_py": random.getstate(), "rng_np": _np_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state() if self.dev.type == "cuda" else None,
                "comm": comm.stats().as_dict(), "plans": self._plans_state(), "speeds": list(self.speeds),
                "overlapped_syncs": self.overlapped_syncs,
                "sched": list(self.plans[self.k + 1][:3]), "dist_prev": self.dist_prev,
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
        _np_set_rng_state(st["rng_np"])
        if self.dev.type == "cuda" and st.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(st["rng_cuda"])
        self.k, self.dist_prev = st["step"], st["dist_prev"]
        # plans: rank 0's plans for the next outer steps; a checkpoint from before them has
        # only "sched", the next step's (gk, rk, lr), with L inner steps on every replica
        self.speeds = list(st.get("speeds", [0.0] * self.world))
        self._load_plans(st.get("plans") or {self.k + 1: [*st["sched"], [self.L] * self.world]})   # resizes speeds too
        self.overlapped_syncs = st.get("overlapped_syncs", 0)
        self.evals, self.samples, self.last_val = st["evals"], st["samples"], tuple(st["last_val"])
        self.spread = tuple(st.get("spread", self.spread))
        self.last_valid = tuple(st.get("last_valid", self.last_valid))
        self.ref_n = st.get("ref_n", st.get("world", self.world))

    def _plans_state(self) -> dict:
        return {j: [p.gk, p.rk, p.lr, list(p.steps)] for j, p in self.plans.items()}

    def _load_plans(self, plans: dict) -> None:
        self.plans = {int(j): Plan(p[0], p[1], p[2], tuple(p[3])) for j, p in plans.items()}
        self.resize_plans()

    def resize_plans(self) -> None:
        """After the world changed (elastic mode, where parle.balance is off): L inner steps
        for every replica of the new world."""
        self.speeds = (self.speeds + [0.0] * self.world)[:self.world]
        self.plans = {j: p if len(p.steps) == self.world else p._replace(steps=(self.L,) * self.world)
                      for j, p in self.plans.items()}

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

    def _raise_ckpt_failure(self, bad: list, k: int) -> None:
        """Every rank, after a sync whose slot rows say a checkpoint write failed: the rank
        that failed raises its own message (printed by that rank); the others a RunError
        (printed by rank 0) naming it."""
        if self.log is not None:
            self.log.flush()
        if self.ckpt_error is not None:
            raise CheckpointError(self.ckpt_error)
        done = checkpoint.latest_complete(self.run_dir, self.world)
        raise RunError(f"run.dir: rank(s) {bad} could not write their checkpoint (their message above); stopped "
                       f"after outer step {k}. The last complete checkpoint (step {done}) is kept in "
                       f"{self.run_dir}/checkpoints")

    # ----------------------------------------------------------------------- the loop
    def loop(self) -> dict:
        """Outer steps ``self.k + 1 .. K``. Every rank makes the same collectives in the same
        order: one sync (or slot exchange) per outer step, one allreduce per evaluation."""
        cfg, K = self.cfg, self.K
        self.model.train()
        for k in range(self.k + 1, K + 1):
            t_step = time.monotonic()
            plan = self.plans[k]                        # rank 0's, received in an earlier sync
            losses, t_inner = self._inner_loop(k, plan)    # no communication (but dpsgd's)
            stop = self._receive(k) if self.inflight else False   # overlap: step k-1's sync, waited for only now
            self._outer_update(k, plan)                 # parle: the elastic pull toward the reference
            if _injected("PARLE_HVD_INJECT_NAN", self.rank, k):
                with torch.no_grad():
                    next(self.model.parameters()).fill_(float("nan"))
            self._send(k, plan, t_step, self._slot(k, losses, t_inner, plan))   # all ranks reach this
            eval_now = k % self.eval_every_steps == 0 or k == K
            ckpt_now = bool(cfg.run.ckpt_every and k % cfg.run.ckpt_every == 0) or k == K
            if not self.overlap or eval_now or ckpt_now or stop or k + 1 not in self.plans:
                stop = self._receive(k) or stop        # this step's own sync: all ranks wait here alike
            self.k = k
            self.samples += sum(plan.steps) * cfg.train.batch_size
            # A stop still evaluates at an evaluation step, so that an interrupted and resumed
            # run makes the same evaluations (and the same summary) as an uninterrupted one.
            if eval_now:
                self._evaluate(k, plan)                 # all ranks reach this
            self.log.progress(k, self._progress_text(k))
            if ckpt_now or stop:
                self.save_ckpt(k, last=k == K or stop)
            if stop and k < K:                          # a stop at K simply finishes
                return self._stopped(k)
            if self.member is not None and self.member.commit_due(k):
                self.member.commit_step(self.last_rows)
        return self.finish()

    def _inner_loop(self, k: int, plan: Plan) -> tuple[list, float]:
        """This replica's inner steps (L, or its share with parle.balance); returns their
        losses (tensors, not synchronised) and the seconds they took (InnerTimer)."""
        cfg, ds, model, algo, dev, dtype = self.cfg, self.ds, self.model, self.algo, self.dev, self.dtype
        timer = InnerTimer(dev)
        algo.begin_outer()
        losses = []
        for _ in range(plan.steps[self.rank]):
            b = self.sampler.next()
            xb = ds.train_x[b]
            if cfg.data.augment:
                xb = augment_batch(xb, self.aug_gen)
            out = algo.module(to_input(xb.to(dev, non_blocking=True), ds.mean, ds.std, dtype))
            loss = self.obj.loss(out, ds.train_y[b].to(dev, non_blocking=True))
            model.zero_grad(set_to_none=True)
            loss.backward()
            algo.inner_step(gk=plan.gk, rk=plan.rk, lr=plan.lr, xbar=self.ref_params)
            losses.append(loss.detach())
        # every rank enters this guard alike, once per outer step (a GPU waits in it for the
        # loop's stream), so the heartbeats' counts stay in step whatever each rank's device
        return losses, timer.seconds(self.dog.collective("inner loop", k))

    def _outer_update(self, k: int, plan: Plan) -> None:
        dump = os.environ.get("PARLE_HVD_DUMP_OUTER")     # testing hook (tests/test_overlap.py)
        if dump:
            opt = self.algo.opt
            before = {"x": [t.clone() for t in opt.x], "z": [t.clone() for t in opt.z],
                      "v_out": [t.clone() for t in opt.v_out], "xbar": [t.clone() for t in self.ref_params]}
        self.algo.end_outer(self.ref_params, rk=plan.rk, lr=plan.lr)
        if dump:
            torch.save({**before, "after": [p.detach().clone() for p in self.algo.params], "rk": plan.rk,
                        "lr": plan.lr, "steps": plan.steps, "step": k},
                       os.path.join(dump, f"outer-rank{self.rank}-step{k}.pt"))

    def _slot(self, k: int, losses: list, t_inner: float, plan: Plan) -> dict:
        """This replica's row in the sync: its losses, its flags, its speed, and (elastic mode,
        rank 0) the coordinator's news of hosts leaving or joining, acted on at this step's commit."""
        lt = torch.stack(losses).double()
        ok = torch.stack([torch.isfinite(lt).all(), *(torch.isfinite(p).all() for p in self.model.parameters())]).all()
        loss, loss_max, finite = torch.stack([lt.mean(), lt.max(), ok.double()]).tolist()   # one device sync
        stop = self.stop.requested is not None or _injected("PARLE_HVD_INJECT_STOP", self.rank, k)
        hosts = self.member.hosts_pending() if self.member is not None and self.member.commit_due(k) else 0.0
        fake = _fake_step_seconds(self.rank)
        return {"loss": loss, "loss_max": loss_max, "distance": self.dist_prev,
                "nonfinite": float(not finite), "stop": float(stop), "ckpt": float(self.ckpt_error is not None),
                "hosts": hosts, "step_seconds": fake if fake is not None else t_inner / len(losses)}

    def _plan(self, j: int) -> Plan:
        """Outer step j's plan: the schedule, and each replica's inner steps: L, or with
        parle.balance a share of n*L in proportion to its measured speed."""
        steps = balance_steps(self.speeds, total=self.world * self.L) if self.balance else [self.L] * self.world
        return Plan(*self.schedule(j), tuple(steps))

    def _plans_after(self, k: int) -> list:
        """Rank 0's plans for steps k+1 and k+2, sent in step k's sync (Exchange.AHEAD)."""
        return [self._plan(k + 1 + i) for i in range(Exchange.AHEAD)]

    def _send(self, k: int, plan: Plan, t_step: float, slot: dict) -> None:
        """Start outer step k's one collective. With a sync, one allreduce: the new reference,
        rank 0's plans for steps k+1 and k+2, every replica's slot row; without one, every
        rank computes the (deterministic) plan and the slot rows travel in one small
        allreduce. All ranks reach this, once per outer step."""
        if self.algo.syncs:
            pending = sync_start(self.model_t, self.ref_t, self.ex, self._plans_after(k) if self.rank == 0 else None,
                                 slot)                 # all ranks reach this
            self.inflight = InFlight(k, plan, t_step, time.monotonic(), pending=pending)
        else:
            self.plans[k + 1] = self._plan(k + 1)
            with self.dog.collective("slots", k):
                rows = exchange_slots(slot, self.rank, self.world)   # all ranks reach this
            self.inflight = InFlight(k, plan, t_step, time.monotonic(), rows=rows)

    def _receive(self, k: int) -> bool:
        """Wait for the sync in flight (outer step j = k, or k-1 with overlap), read rank 0's
        plans and every replica's slot row, log step j, and act on the rows: a non-finite
        replica or a failed checkpoint write stops every rank (raises); returns whether a
        rank was asked to stop. Every rank sees the same rows, so all act alike."""
        rec, self.inflight = self.inflight, None
        if rec.pending is not None:
            with self.dog.collective("sync", rec.step):
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
        for a, sec in enumerate(rows[:, 7].tolist()):
            if sec > 0:                                # smoothed: one slow step must not swing the plan
                self.speeds[a] = sec if self.speeds[a] <= 0 else 0.5 * self.speeds[a] + 0.5 * sec
        self.last_rows, self.last_loss, self.loss_step = rows, float(rows[:, 0].mean()), rec.step
        self.overlapped_syncs += rec.pending is not None and rec.step < k
        dt = (time.monotonic() if rec.step == k else rec.t_sent) - rec.t_start
        self._log_step(rec.step, rows, dt, rec.plan)
        return self._check_rows(rec.step, rows)

    def _log_step(self, k: int, rows, dt: float, plan: Plan) -> None:
        if self.rank != 0 or not (k % self.log_every_steps == 0 or k == self.K):
            return
        cs, algo, gk, rk = comm.stats(), self.algo, plan.gk, plan.rk
        sc = {"train/loss": rows[:, 0].mean(), "train/loss_max": rows[:, 0].max(),
              "train/loss_max_inner": rows[:, 1].max(), "parle/lr": plan.lr,
              "comm/bytes": cs.bytes, "comm/allreduce_calls": cs.allreduce_calls,
              "perf/samples_per_sec": sum(plan.steps) * self.cfg.train.batch_size / max(dt, 1e-9),
              "perf/step_seconds": dt, "train/passes": k * self.L / self.nb}
        if self.balance:                  # what each replica did in step k, and how fast
            sc.update({f"balance/inner_steps/{a}": n for a, n in enumerate(plan.steps)})
            sc.update({f"balance/step_seconds/{a}": v for a, v in enumerate(rows[:, 7].tolist())})
        if self.member is not None:
            sc["dist/world_size"] = self.world
        if "gamma" in algo.couplings:
            sc.update({"parle/gamma": 1.0 / gk if gk > 0 else None, "parle/gamma_inv": gk})
        if "rho" in algo.couplings:
            sc.update({"parle/rho": 1.0 / rk if rk > 0 else None, "parle/rho_inv": rk})
        if algo.syncs:
            sc.update({"parle/replica_distance": rows[:, 2].mean(), "parle/replica_distance_max": rows[:, 2].max()})
        self.log.scalars(k, sc)

    def _check_rows(self, k: int, rows) -> bool:
        """Act on every replica's flags: stop all ranks together on a non-finite replica or a
        failed checkpoint write (raises); returns whether a rank was asked to stop."""
        if bool(rows[:, 3].any()):
            bad = [i for i in range(len(rows)) if rows[i, 3] > 0]
            last = checkpoint.latest_complete(self.run_dir, self.world)
            self.log.flush()
            raise DivergenceError(f"non-finite loss or weights on rank(s) {bad} at outer step {k}; stopped. "
                                  f"The last complete checkpoint (step {last}) is kept in {self.run_dir}/checkpoints")
        if bool(rows[:, 6].any()):
            self._raise_ckpt_failure([i for i in range(len(rows)) if rows[i, 6] > 0], k)
        stops = [i for i in range(len(rows)) if rows[i, 4] > 0]
        self.stop_ranks.update(stops)
        return bool(stops)

    def _progress_text(self, k: int) -> str:
        """With parle.overlap the newest rows are the previous step's (none yet at step 1):
        the line says which step its loss is from rather than print a NaN."""
        loss = ("loss -" if self.loss_step is None else f"loss {self.last_loss:.3f}"
                + (f" (step {self.loss_step})" if self.loss_step != k else ""))
        return loss + (f" val {self.last_val[0]:.4f}" if self.evals else " val -")

    def _evaluate(self, k: int, plan: Plan) -> None:
        """Evaluate the reference (test, and validation with data.val_frac). All ranks reach this."""
        cfg, algo, ds = self.cfg, self.algo, self.ds
        t_eval = time.monotonic()
        with self.dog.collective("evaluation", k):
            algo.form_reference(self.model_t, self.ref_t)     # all ranks reach this (a no-op for syncing algorithms)
            recompute_bn(self.ref, ds, cfg.eval.bn_batches, cfg.train.batch_size, cfg.train.seed, k, self.dtype, self.dev)
            acc, vloss, drows, valid = evaluate(self.ref, ds, self.rank, self.world, cfg.eval.batch_size, self.dtype,
                                                self.dev, [self.dist_prev], self.obj)
        if algo.syncs:
            self.spread = (float(drows.mean()), float(drows.max()))   # ||x_a - xbar|| now, every replica
        self.evals += 1
        self.eval_wall += time.monotonic() - t_eval
        self.last_val = (acc, vloss)
        passes = k * self.L / self.nb
        m = self.obj.metric                   # accuracy, loss, perplexity or the user's metric
        sc = {f"val/{m}": acc, "val/loss": vloss,   # val/*: the test set
              "comm/allreduce_calls": comm.stats().allreduce_calls, "comm/bytes": comm.stats().bytes,
              "train/passes": passes, "train/wall_seconds": self.wall(), "train/eval_seconds": self.eval_wall}
        if m == "accuracy":
            sc["val/error"] = 1 - acc
        if valid is not None:
            self.last_valid = valid
            sc.update({f"valid/{m}": valid[0], "valid/loss": valid[1]})
            if m == "accuracy":
                sc["valid/error"] = 1 - valid[0]
        self.log.scalars(k, sc)
        short = "acc" if m == "accuracy" else m
        self.log.info(f"step {k}/{self.K} pass {passes:.2f}: "
                      + (f"valid {short} {valid[0]:.4f}, " if valid is not None else "")
                      + f"test {short} {acc:.4f} loss {vloss:.4f}, train loss {self.last_loss:.4f}, lr {plan.lr:.3g}"
                      + (f" gamma_inv {plan.gk:.3g}" if "gamma" in algo.couplings else "")
                      + (f" rho_inv {plan.rk:.3g}" if "rho" in algo.couplings else "")
                      + (f", {self.world} ranks" if self.member is not None else ""))
        self.model.train()

    def _stopped(self, k: int) -> dict:
        who = sorted(self.stop_ranks)
        self.log.info(f"stopped after outer step {k} on a signal to rank(s) {who}; checkpoint written; "
                      f"resume with run.resume=true run.dir={self.run_dir}")
        self.log.close()
        return {"stopped_at": k, "run_dir": str(self.run_dir)}

    def _inference_card(self) -> dict:
        """What final.pt (the reference's state_dict, loadable with weights_only=True into
        the model's own class) needs to be used alone: the model and how it was built, the
        input's shape and normalisation, and the resolved config."""
        cfg, ds = self.cfg, self.ds
        return {"weights": "final.pt", "model": {"name": "" if cfg.model.target else cfg.model.name,
                                                 "target": cfg.model.target, "kwargs": cfg.model.kwargs,
                                                 "dtype": cfg.model.dtype},
                "input": {"shape": list(ds.shape), "dtype": str(ds.train_x.dtype).replace("torch.", ""),
                          # built-in images: input = (uint8 / 255 - mean) / std, per channel
                          "mean": list(ds.mean) if ds.mean is not None else None,
                          "std": list(ds.std) if ds.std is not None else None},
                "num_classes": ds.num_classes, "metric": self.obj.metric, "algo": cfg.algo,
                "config": to_dict(cfg)}

    def finish(self) -> dict:
        cfg, log = self.cfg, self.log
        wall = self.wall()
        cs = comm.stats()
        K, L = self.K, self.L
        # val_accuracy/val_loss: the test set (the historical names); valid_*: the held-out
        # validation split of the training set (data.val_frac; NaN without one)
        m = self.obj.metric
        # (with eval.metric other than accuracy: test_<metric>, valid_<metric>, no *_accuracy)
        figures = {f"val_{m}": self.last_val[0]} if m == "accuracy" else {}
        figures.update({"val_loss": self.last_val[1], f"test_{m}": self.last_val[0], "test_loss": self.last_val[1],
                        f"valid_{m}": self.last_valid[0], "valid_loss": self.last_valid[1]})
        summary = {"metric": m, **figures, "wall_seconds": wall,
                   "eval_seconds": self.eval_wall, "outer_steps": K, "inner_steps": K * L, "sync_period": L,
                   "passes": K * L / self.nb, "overlap": self.overlap, "balance": "time" if self.balance else "off",
                   "overlapped_syncs": self.overlapped_syncs,
                   "evaluations": self.evals, "samples_seen": self.samples, "allreduce_calls": cs.allreduce_calls,
                   "broadcast_calls": cs.broadcast_calls, "bytes_communicated": cs.bytes,
                   "allreduce_bytes": cs.allreduce_bytes, "broadcast_bytes": cs.broadcast_bytes,
                   "final_replica_distance": self.spread[0], "final_replica_distance_max": self.spread[1],
                   "params": self.n_params, "world_size": self.world, "algo": cfg.algo,
                   "engine": comm.engine(), "controller": comm.controller(), "device": str(self.dev),
                   "resumed_from": self.resumed_from,
                   "elastic": cfg.dist.elastic, "elastic_events": self.member.events if self.member else [],
                   "elastic_commit_seconds": self.member.commit_seconds if self.member else 0.0,
                   "config": to_dict(cfg)}
        if self.rank == 0:
            try:   # each written whole or not at all
                checkpoint.atomic_save(self.ref.state_dict(), self.run_dir / "final.pt")
                checkpoint.atomic_write_text(self.run_dir / "final.json", json.dumps(self._inference_card(), indent=2))
                checkpoint.atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            except OSError as e:
                raise CheckpointError(f"run.dir: cannot write final.pt/summary.json in {self.run_dir} "
                                      f"({e.strerror or e}); the last complete checkpoint is kept") from None
            log.info(f"done: test {m} {self.last_val[0]:.4f}, {wall:.1f} s, {cs.allreduce_calls} allreduces, "
                     f"{cs.bytes / 1e6:.2f} MB; {self.run_dir}/summary.json")
        log.close()
        return summary


def train(cfg: Config) -> dict:
    """Run ``cfg`` on this rank; every rank calls this. Returns the summary (rank 0 also
    writes it to ``<run.dir>/summary.json``)."""
    return Trainer(cfg).run()
