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
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint, comm
from .algorithms import ALGORITHMS
from .checkpoint import CheckpointError
from .config import Config, to_dict
from .data import ReplicaSampler, augment_batch, common_nb, hold_out, load_dataset, replica_indices, to_input, _gen
from .evaluation import evaluate, recompute_bn
from .exchange import SLOT, Exchange, exchange_slots, outer_schedule, replica_distance, sync
from .logger import RunLogger
from .membership import Membership
from .models import build_model, sync_tensors
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


class Trainer:
    """One rank's run: its replica, the reference, and the loop.

    Without elastic mode ``run()`` is ``start()`` then ``loop()``. In elastic mode
    (``dist.elastic``) Horovod's ``elastic.run`` drives the same ``loop()`` through
    ``Membership`` (membership.py), whose ``sync`` takes the place of ``start()``."""

    def __init__(self, cfg: Config):
        comm.init(cfg.dist.backend, set_threads=cfg.dist.threads == 0, timeout=cfg.dist.timeout)
        if cfg.dist.threads:
            torch.set_num_threads(cfg.dist.threads)
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
        self.member = Membership(self)
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
        return {"config": to_dict(cfg), "versions": versions(), "git_sha": git_sha(), "world_size": self.world,
                "device": str(self.dev), "algo": cfg.algo, "elastic": cfg.dist.elastic,
                "controller": comm.controller(), "outer_steps": self.K, "inner_steps_per_outer": self.L,
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
            log.info(f"parle_hvd: {cfg.algo}, {world} rank(s) [{comm.controller()}{', elastic' if self.member else ''}, "
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

    def run_state(self) -> dict:
        """The loop's counters, sent to a replica that joins (elastic mode)."""
        return {"k": self.k, "sched": self.sched, "evals": self.evals, "samples": self.samples,
                "last_val": self.last_val, "last_valid": self.last_valid, "spread": self.spread,
                "wall": self.wall(), "eval_wall": self.eval_wall, "resumed_from": self.resumed_from,
                "ref_n": self.ref_n}

    def load_run_state(self, st: dict) -> None:
        """The counters ``run_state`` gave; the wall clock goes on from ``st["wall"]``."""
        self.k, self.sched, self.evals, self.samples = st["k"], tuple(st["sched"]), st["evals"], st["samples"]
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

    # ----------------------------------------------------------------------- the loop
    def loop(self) -> dict:
        """Outer steps ``self.k + 1 .. K``. Every rank makes the same collectives in the same
        order: one sync (or slot exchange) per outer step, one allreduce per evaluation."""
        cfg, K = self.cfg, self.K
        self.model.train()
        for k in range(self.k + 1, K + 1):
            t_step = time.monotonic()
            gk, rk, lr = self.sched                     # rank 0's values, received at the last sync
            losses = self._inner_loop(gk, rk, lr)       # L inner steps: no communication (but dpsgd's)
            self.algo.end_outer(self.ref_params, rk=rk, lr=lr)   # parle: the elastic pull toward the reference
            if _injected("PARLE_HVD_INJECT_NAN", self.rank, k):
                with torch.no_grad():
                    next(self.model.parameters()).fill_(float("nan"))
            rows = self._sync(k, self._slot(k, losses))          # all ranks reach this
            self.k = k
            self.samples += self.world * self.L * cfg.train.batch_size
            self._log_step(k, rows, time.monotonic() - t_step, gk, rk, lr)
            stopped = self._check_rows(k, rows)         # every rank sees the same rows: all act alike
            # A stop still evaluates at an evaluation step, so that an interrupted and resumed
            # run makes the same evaluations (and the same summary) as an uninterrupted one.
            if k % self.eval_every_steps == 0 or k == K:
                self._evaluate(k, rows, gk, rk, lr)     # all ranks reach this
            self.log.progress(k, f"loss {float(rows[:, 0].mean()):.3f} val {self.last_val[0]:.4f}")
            if (cfg.run.ckpt_every and k % cfg.run.ckpt_every == 0) or k == K or stopped:
                self.save_ckpt(k, last=k == K or stopped)
            if stopped and k < K:                       # a stop at K simply finishes
                return self._stopped(k, rows)
            if self.member is not None and self.member.commit_due(k):
                self.member.commit_step(rows)
        return self.finish()

    def _inner_loop(self, gk: float, rk: float, lr: float) -> list:
        """This replica's L inner steps; returns their losses (tensors, not synchronised)."""
        cfg, ds, model, algo, dev, dtype = self.cfg, self.ds, self.model, self.algo, self.dev, self.dtype
        algo.begin_outer()
        losses = []
        for _ in range(self.L):
            b = self.sampler.next()
            xb = ds.train_x[b]
            if cfg.data.augment:
                xb = augment_batch(xb, self.aug_gen)
            out = model(to_input(xb.to(dev, non_blocking=True), ds.mean, ds.std, dtype))
            loss = F.cross_entropy(out, ds.train_y[b].to(dev, non_blocking=True))
            model.zero_grad(set_to_none=True)
            loss.backward()
            algo.inner_step(gk=gk, rk=rk, lr=lr, xbar=self.ref_params)
            losses.append(loss.detach())
        return losses

    def _slot(self, k: int, losses: list) -> dict:
        """This replica's row in the sync: its losses, its flags, and (elastic mode, rank 0)
        the coordinator's news of hosts leaving or joining, acted on at this step's commit."""
        lt = torch.stack(losses).double()
        finite = bool(torch.isfinite(lt).all()) and all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        stop = self.stop.requested is not None or _injected("PARLE_HVD_INJECT_STOP", self.rank, k)
        hosts = self.member.hosts_pending() if self.member is not None and self.member.commit_due(k) else 0.0
        return {"loss": float(lt.mean()), "loss_max": float(lt.max()), "distance": self.dist_prev,
                "nonfinite": float(not finite), "stop": float(stop), "ckpt": float(self.ckpt_error is not None),
                "hosts": hosts}

    def _sync(self, k: int, slot: dict) -> torch.Tensor:
        """The one collective of outer step k; returns every replica's slot row. All ranks reach this."""
        if self.algo.syncs:
            # One allreduce: the new reference, rank 0's schedule for step k+1, every replica's slot.
            with self.dog.collective("sync", k):
                self.sched, rows = sync(self.model_t, self.ref_t, self.ex,
                                        self.schedule(k + 1) if self.rank == 0 else None, slot)
            self.ref_n = self.world
            self.dist_prev = replica_distance(self.model, self.ref)
            self.algo.after_sync(self.model_t, self.ref_t)
            return rows
        # Every rank computes the (deterministic) schedule; one small allreduce of the slots.
        self.sched = self.schedule(k + 1)
        with self.dog.collective("slots", k):
            return exchange_slots(slot, self.rank, self.world)

    def _log_step(self, k: int, rows, dt: float, gk: float, rk: float, lr: float) -> None:
        if self.rank != 0 or not (k % self.log_every_steps == 0 or k == self.K):
            return
        cs, algo = comm.stats(), self.algo
        sc = {"train/loss": rows[:, 0].mean(), "train/loss_max": rows[:, 0].max(),
              "train/loss_max_inner": rows[:, 1].max(), "parle/lr": lr,
              "comm/bytes": cs.bytes, "comm/allreduce_calls": cs.allreduce_calls,
              "perf/samples_per_sec": self.world * self.L * self.cfg.train.batch_size / max(dt, 1e-9),
              "train/passes": k * self.L / self.nb}
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
            self._raise_ckpt_failure([i for i in range(len(rows)) if rows[i, 6] > 0])
        return bool(rows[:, 4].any())

    def _evaluate(self, k: int, rows, gk: float, rk: float, lr: float) -> None:
        """Evaluate the reference (test, and validation with data.val_frac). All ranks reach this."""
        cfg, algo, ds = self.cfg, self.algo, self.ds
        t_eval = time.monotonic()
        with self.dog.collective("evaluation", k):
            algo.form_reference(self.model_t, self.ref_t)     # all ranks reach this (a no-op for syncing algorithms)
            recompute_bn(self.ref, ds, cfg.eval.bn_batches, cfg.train.batch_size, cfg.train.seed, k, self.dtype, self.dev)
            acc, vloss, drows, valid = evaluate(self.ref, ds, self.rank, self.world, cfg.eval.batch_size, self.dtype,
                                                self.dev, [self.dist_prev])
        if algo.syncs:
            self.spread = (float(drows.mean()), float(drows.max()))   # ||x_a - xbar|| now, every replica
        self.evals += 1
        self.eval_wall += time.monotonic() - t_eval
        self.last_val = (acc, vloss)
        passes = k * self.L / self.nb
        sc = {"val/accuracy": acc, "val/loss": vloss, "val/error": 1 - acc,   # val/*: the test set
              "comm/allreduce_calls": comm.stats().allreduce_calls, "comm/bytes": comm.stats().bytes,
              "train/passes": passes, "train/wall_seconds": self.wall(), "train/eval_seconds": self.eval_wall}
        if valid is not None:
            self.last_valid = valid
            sc.update({"valid/accuracy": valid[0], "valid/loss": valid[1], "valid/error": 1 - valid[0]})
        self.log.scalars(k, sc)
        self.log.info(f"step {k}/{self.K} pass {passes:.2f}: "
                      + (f"valid acc {valid[0]:.4f}, " if valid is not None else "")
                      + f"test acc {acc:.4f} loss {vloss:.4f}, train loss {float(rows[:, 0].mean()):.4f}, lr {lr:.3g}"
                      + (f" gamma_inv {gk:.3g}" if "gamma" in algo.couplings else "")
                      + (f" rho_inv {rk:.3g}" if "rho" in algo.couplings else "")
                      + (f", {self.world} ranks" if self.member is not None else ""))
        self.model.train()

    def _stopped(self, k: int, rows) -> dict:
        who = [i for i in range(len(rows)) if rows[i, 4] > 0]
        self.log.info(f"stopped after outer step {k} on a signal to rank(s) {who}; checkpoint written; "
                      f"resume with run.resume=true run.dir={self.run_dir}")
        self.log.close()
        return {"stopped_at": k, "run_dir": str(self.run_dir)}

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
                   "elastic": cfg.dist.elastic, "elastic_events": self.member.events if self.member else [],
                   "elastic_commit_seconds": self.member.commit_seconds if self.member else 0.0,
                   "config": to_dict(cfg)}
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
