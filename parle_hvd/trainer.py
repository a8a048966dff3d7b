"""The training loop: one MPI rank = one replica, driven through the public optimizer.

    horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
    mpirun -np 4 python train.py --config configs/fashion_parle.yaml parle.sync_period=50
    launch/elastic.sh ...        # Horovod's elastic mode: membership.py

``Trainer.loop`` is the loop any user writes around ``parle_hvd.optim`` (examples/own_loop.py):
``next_plan()`` says how many inner steps this replica takes in the next outer step; each
is a batch, a forward, a backward and ``opt.step()``, whose last call makes the outer update
and the outer step's one sync. What is left here is the run around it: data, evaluation,
logging, checkpoints and signals. ``start`` comes before it (rank 0 resolves the run and any
checkpoint, rundir.py; every rank builds its replica; the first sync or the resume).

A run of K outer steps with E evaluations makes exactly K + 1 + E allreduces (the +1 forms
the first reference from the independently initialised replicas; an evaluation is one
allreduce of float64 sums).

With ``parle.overlap`` the sync of step k travels while step k+1's inner steps run
(optim.py). A step that evaluates, checkpoints or stops waits for its own sync at once
(``opt.synchronize()``), so the reference evaluated and saved, and a resume, are exactly
those of the blocking loop. docs/algorithm.md, "Overlapped sync" and "Balanced inner steps".
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from typing import Optional

import torch

from . import checkpoint, comm, report
from .report import COL
from .algorithms import ALGORITHMS
from .assemble import configure_torch, inference_card, load_data, new_model, pick_device, resolve_objective, rng_state, seed_replica, \
    set_rng_state
from .checkpoint import CheckpointError
from .config import Config, to_dict
from .data import PROGRESS, DataError, ReplicaSampler, common_nb, replica_indices, to_device, to_input, _gen
from .stream import ShardSampler, make_feed, shard_windows
from .evaluation import evaluate, recompute_bn
from .exchange import outer_schedule
from .logger import RunLogger
from .membership import Membership, run_torchrun_elastic
from .optim import DistributedOptimizer, SyncReport, _injected
from .rundir import RunError, discard_if_empty, resume_point, start_run
from .watchdog import StopSignal, Watchdog

# torch.optim.Optimizer imports torch._dynamo on first use, 2-3 s here. A launched rank pays
# it now, before the first collective, rather than between the end of loading and the first
# sync, where a waiting rank counts it against dist.timeout. A single process pays it at its
# first optimizer, after its config, data and targets are checked: bad input is refused 2 s
# sooner.
def _launched() -> bool:
    try:
        return comm.launched()
    except comm.EngineError:      # a malformed launcher environment: Trainer() says so in one line
        return True


if _launched():
    import torch._dynamo  # noqa: F401

__all__ = ["Trainer", "train", "RunError", "DivergenceError"]


def _inject_slow_load(rank: int) -> None:
    """Tests: ``PARLE_HVD_INJECT_SLOW_LOAD=<rank>:<seconds>`` makes that rank's loading take
    that long, counting progress; ``<rank>:hang`` makes it stop counting (a stuck read)."""
    spec = os.environ.get("PARLE_HVD_INJECT_SLOW_LOAD", "")
    r, _, what = spec.partition(":")
    if not spec or int(r) != rank:
        return
    if what == "hang":
        time.sleep(3600)
    for _ in range(int(float(what) * 10)):
        time.sleep(0.1)
        PROGRESS[0] += 1


def _kept(step, run_dir=None, *, sentence: bool = True) -> str:
    """The end of a stop's message: the checkpoint a resume would start from (and where, given
    ``run_dir``), or that there is none (``run.resume=true`` would be refused: run again
    without it). ``sentence``: it starts a sentence (a capital letter)."""
    if step is None:
        text = "no complete checkpoint was written yet: nothing to resume from"
    else:
        text = f"the last complete checkpoint (step {step}) is kept" + (f" in {run_dir}/checkpoints" if run_dir else "")
    return text[0].upper() + text[1:] if sentence else text


class DivergenceError(RuntimeError):
    """Non-finite loss or weights; one line, exit 3, the last complete checkpoint kept."""


class Trainer:
    """One rank's run: its replica and optimizer (``self.opt``), and the loop.

    Without elastic mode ``run()`` is ``start()`` then ``loop()``. In elastic mode
    (``dist.elastic``) Horovod's ``elastic.run`` drives the same ``loop()`` through
    ``Membership`` (membership.py), whose ``sync`` takes the place of ``start()``."""

    def __init__(self, cfg: Config, *, give_back_signals: bool = True):
        try:
            # timeout=0: the engines' own timeouts off; the watchdog (dist.timeout) is the one
            # timeout, since only it tells a rank still loading its data from a lost one
            comm.init(cfg.dist.backend, set_threads=cfg.dist.threads == 0, timeout=0,
                      engine=cfg.dist.engine, gpu_backend="gloo" if cfg.dist.share_device else "nccl")
        except comm.EngineError as e:
            raise RunError(str(e)) from None
        configure_torch(cfg)
        comm.reset_stats()       # this run's communication (a resume restores its total from the checkpoint)
        self.cfg, self.rank, self.world = cfg, comm.rank(), comm.size()
        self.stop = StopSignal(self.rank)
        self.stop.install()
        # train.py ends the process right after the run: its handlers stay (a late SIGTERM is
        # harmless, the exit code stays 0); a script that goes on gets its own back
        self.give_back_signals = give_back_signals
        self.dog = Watchdog(cfg.dist.timeout, self.rank, self.world)
        self.member: Optional[Membership] = None    # elastic mode only
        self.ckpt_error = None       # this rank's failed checkpoint write, reported at the next sync
        self.created_dir = None      # what rank 0 made for the run directory in this start (removed if the start fails)
        self.log = self.opt = None
        self.built, self.resumed_from, self.ckpt_world, self.t_start = False, None, self.world, time.monotonic()
        self.obj = self.ds = self.feed = None      # the objective and the data: build()
        self.last_row = None         # (outer step, scalars) of the last step logged

    @property
    def k(self) -> int:
        """Outer steps completed."""
        return self.opt.k

    def run(self) -> dict:
        try:
            return self._run()
        except DataError as e:
            # A corrupt file met in training or evaluation is usually this rank's alone (each
            # replica reads its own examples), and so are stuck workers, even before the
            # first sync: say it here, since only rank 0's line is printed.
            if self.rank != 0 and (self.log is not None or getattr(e, "own", False)):
                sys.stderr.write(f"error: rank {self.rank}: {e}\n")      # an error: line, as launcher.py finds them
                sys.stderr.flush()
            raise
        finally:
            self.dog.close()
            try:
                if self.feed is not None:     # end the DataLoader workers on every way out
                    self.feed.close()
                if self.log is not None:      # and flush the logs (TensorBoard's too): nothing is left to exit
                    with contextlib.suppress(OSError):      # a full disk: the error on its way out is the one to tell
                        self.log.close()
            finally:
                if self.give_back_signals:    # last: a signal during the above still only asks for a stop
                    self.stop.uninstall()

    def _run(self) -> dict:
        cfg = self.cfg
        if not cfg.dist.elastic:
            if cfg.dist.expect_ranks and cfg.dist.expect_ranks != self.world:
                raise RunError(f"dist.expect_ranks: this config is meant for {cfg.dist.expect_ranks} ranks, "
                               f"launched with {self.world} (override dist.expect_ranks=0 to run anyway)")
            self.start()
            return self.loop()
        if comm.engine() == "torch":
            return run_torchrun_elastic(self)
        if not comm.elastic_launched():
            raise RunError("dist.elastic: start the job with horovodrun's elastic mode (launch/elastic.sh: "
                           "--min-np, --max-np, --host-discovery-script)")
        self.member = Membership(self)
        return self.member.run()

    # ----------------------------------------------------------------------- building
    def build(self, replica_id: int, world0: int, *, init_bcast: bool) -> None:
        """This rank's replica: data, sampler, model and optimizer, and the loop's counters.
        ``replica_id`` names the replica (its seed, its data order and window): the rank,
        except for a replica that joins an elastic run. ``world0`` is the world size the
        data windows were cut for."""
        cfg = self.cfg
        self.dtype = getattr(torch, cfg.model.dtype)
        self.dev = dev = pick_device(cfg.dist.device, cfg.dist.share_device)
        if dev.type == "cuda":           # this run's peak, not an earlier run's in this process
            torch.cuda.reset_peak_memory_stats(dev)
        self.replica_id, self.world0 = replica_id, world0
        if self.ds is None:
            # Before the first sync, and maybe long (an in-memory dataset decoded, a streamed
            # one's file list and statistics): the heartbeat says this rank is loading, so the
            # ranks waiting for it do not take it for lost. Any user target is imported and
            # tried here, on every rank alike (a bad one ends every rank with the same line).
            # A signal here ends the rank at once (nothing trained yet), except in elastic modes,
            # where a rank may be joining a running job: there it asks for a stop in the next sync.
            at_once = self.stop.at_once("loading data") if not cfg.dist.elastic else contextlib.nullcontext()
            with self.dog.busy("loading data", lambda: PROGRESS[0]), at_once:
                _inject_slow_load(self.rank)
                self.obj, self.ds = resolve_objective(cfg, load_data(cfg))
        # In memory, every replica holds the whole dataset (uint8, on its device, moved once);
        # streamed, its workers decode its batches. Either way each replica has its own window
        # and order; data-parallel SGD gives each rank a disjoint shard (frac = 1/n).
        ds = self.ds if self.ds.streamed else to_device(self.ds, dev)
        self.ds = ds
        shard = ALGORITHMS[cfg.algo].shard_data and world0 > 1
        split, frac = ("frac", 1.0 / world0) if shard else (cfg.data.split, cfg.data.frac)
        B, seed = cfg.train.batch_size, cfg.train.seed
        if ds.streamed and ds.train.kind == "shards":    # windows of whole shards, read in order
            per_shard, windows = shard_windows(ds, world=world0, split=split, frac=frac, seed=seed)
            nb = min(sum(len(per_shard[s]) for s in w) for w in windows) // B
            self.sampler = ShardSampler(per_shard, windows[replica_id % world0], B, seed=seed, rank=replica_id, nb=nb,
                                        group=ds.shuffle_shards)
        else:
            idx = replica_indices(ds.n_train, rank=replica_id, world=world0, split=split, frac=frac, seed=seed)
            # the same number of batches per pass on every replica, whatever its window's size
            nb = common_nb(ds.n_train, world=world0, split=split, frac=frac, batch_size=B)
            self.sampler = ReplicaSampler(idx, B, seed=seed, rank=replica_id, nb=nb,
                                          device=None if ds.streamed else ds.train_x.device)
        self.nb = nb = self.sampler.nb
        self.aug_gen = _gen("augment", seed, replica_id, device=dev)
        if self.feed is not None:
            self.feed.close()
        self.feed = make_feed(ds, self.sampler, augment=cfg.data.augment, aug_gen=self.aug_gen, dev=dev,
                              replica=replica_id, seed=seed)
        # Replica: independent initialisation (seed + replica) unless asked to start from rank 0's.
        seed_replica(cfg.train.seed + replica_id)
        self.model = new_model(cfg, ds).to(device=dev, dtype=self.dtype)
        if cfg.train.channels_last:    # 4-D weights only; the sync packs tensors in logical order
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt = opt = DistributedOptimizer(
            self.model, cfg, watchdog=self.dog, init_broadcast=init_bcast, flags=self._flags,
            schedule=lambda k: outer_schedule(k, L=opt.L, nb=nb, parle=cfg.parle, optim=cfg.optim,
                                              epochs=cfg.train.epochs))
        opt.register_sync_hook(self._on_sync)
        T = cfg.train
        # Speed on accelerators: autocast around forward and loss (the weights, Parle's state
        # and the sync stay in model.dtype: the master copy), a GradScaler for fp16, and one
        # compiled module that trains the replica and evaluates the reference.
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(T.precision)
        self.scaler = torch.amp.GradScaler(dev.type, enabled=T.precision == "fp16")
        self.net = torch.compile(opt.module) if T.compile else opt.module
        self.perf = [0.0, 0]          # inner-step milliseconds summed over syncs, and syncs (this process)
        self.graphs0 = report.compiled_graphs() if T.compile else 0    # earlier runs' graphs in this process
        self.graphs_seen = self.graphs0
        self.L = L = opt.L
        # The same on every rank: window sizes do not depend on the rank.
        self.K = max(1, math.ceil(cfg.train.epochs * nb / L))
        self.eval_every_steps = max(1, round(cfg.eval.every * nb / L))
        self.log_every_steps = max(1, math.ceil(cfg.run.log_every / L))
        self.n_params = sum(p.numel() for p in self.model.parameters())
        # State carried across outer steps (and checkpoints), beside the optimizer's.
        self.wall_before, self.evals, self.samples = 0.0, 0, 0
        self.eval_wall = 0.0         # seconds spent evaluating (in wall()): time to accuracy can leave it out
        self.last_loss, self.loss_step = float("nan"), None   # the newest rows' mean training loss, and their step
        self.stop_ranks: set = set()  # ranks whose slot rows asked for a stop (with overlap they arrive a step early)
        self.last_val = (float("nan"), float("nan"))       # test metric and loss at the last evaluation
        self.last_valid = (float("nan"), float("nan"))     # the same on the validation split (data.val_frac)
        self.spread = (float("nan"), float("nan"))
        self.corrupt_skipped = 0     # every rank's corrupt images skipped (data.skip_corrupt), summed at the last evaluation
        self.built = True

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
            self.cfg, self.run_dir, steps, self.ckpt_world, self.created_dir = start_run(self.cfg, rank)
        cfg = self.cfg
        self.dog.attach(self.run_dir)
        resume_step, st, skipped = None, {}, []
        if steps:
            with self.dog.collective("resume agreement", 0):
                resume_step, st, skipped = resume_point(self.run_dir, steps, rank, self.ckpt_world)
        self.resumed_from = resume_step
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
            self.wall_before, self.eval_wall = st["wall"], st.get("eval_wall", 0.0)
        opt, header = self.opt, report.run_header(self)
        # Only now, with the config and any checkpoint accepted, touch the run directory's files.
        self.open_log(resume_step or 0)
        log = self.log
        if rank == 0:
            (self.run_dir / ("run.json" if resume_step is None else f"run-resume-{resume_step}.json")).write_text(
                json.dumps(header, indent=2))
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            log.info(f"parle_hvd: {cfg.algo}, {world} rank(s) [{comm.engine()} {comm.controller()}"
                     f"{', elastic' if self.member else ''}, {self.dev}], {self.K} outer steps of {self.L} inner "
                     f"steps, {self.nb} batches/pass, run dir {self.run_dir}")
            log.info(f"versions {header['versions']} git {header['git_sha'][:12]}")
            if self.ds.streamed:
                log.info(f"data: {self.ds.name} streamed, {self.ds.n_train} training examples, {cfg.data.workers} "
                         f"worker(s) per rank, input {list(self.ds.shape)}")
            log.text("run", json.dumps(header, indent=2))
        if resume_step is None:
            opt.start()                 # the first reference and rank 0's first plans: all ranks reach this
        else:
            if rank == 0:
                for s in skipped:
                    where = checkpoint.set_aside(self.run_dir, s)
                    log.info(f"run.resume: checkpoint step {s} does not load on every rank; skipped, moved to {where}")
                checkpoint.discard_after(self.run_dir, resume_step)
                log.info(f"resumed from checkpoint step {resume_step}"
                         + (f" (written by {self.ckpt_world} ranks)" if self.ckpt_world != world else ""))
            if self.member is not None and self.ckpt_world > world and opt.algo.ref_is_mean:
                self.member.reform_reference([True] * world)   # all ranks reach this: the dropped replicas leave the mean
        self.t_start = time.monotonic()
        return True

    # ----------------------------------------------------------------------- state
    def wall(self) -> float:
        return self.wall_before + (time.monotonic() - self.t_start)

    def run_state(self) -> dict:
        """The loop's counters, sent to a replica that joins (elastic mode)."""
        return {"k": self.k, "plans": self.opt.plans_state(), "evals": self.evals, "samples": self.samples,
                "last_val": self.last_val, "last_valid": self.last_valid, "spread": self.spread,
                "corrupt_skipped": self.corrupt_skipped, "wall": self.wall(), "eval_wall": self.eval_wall,
                "resumed_from": self.resumed_from, "ref_n": self.opt.ref_n}

    def load_run_state(self, st: dict) -> None:
        """The counters ``run_state`` gave; the wall clock goes on from ``st["wall"]``."""
        self.opt.k, self.opt.ref_n, self.evals, self.samples = st["k"], st["ref_n"], st["evals"], st["samples"]
        self.opt.load_plans(st["plans"])
        self.last_val, self.last_valid, self.spread = tuple(st["last_val"]), tuple(st["last_valid"]), tuple(st["spread"])
        self.corrupt_skipped = st["corrupt_skipped"]
        self.wall_before, self.eval_wall, self.resumed_from = st["wall"], st["eval_wall"], st["resumed_from"]

    def state_dict(self) -> dict:
        """This rank's whole state after outer step ``self.k``: a checkpoint file's content
        (it loads with ``torch.load(weights_only=True)``), or (elastic mode) a commit: the
        optimizer's state, the model's, the data order's and the random streams'. Tensors
        are the live ones: copy before keeping."""
        return {**self.opt.state_dict(), "world": self.world, "params": self.n_params, "algo": self.cfg.algo,
                "replica": self.replica_id, "world0": self.world0, "model": self.model.state_dict(),
                "sampler": self.sampler.state_dict(), "aug_gen": self.aug_gen.get_state(), **rng_state(self.dev),
                "scaler": self.scaler.state_dict(), "data_skipped": self.feed.skipped,
                "comm": comm.stats().as_dict(), "wall": self.wall(), "eval_wall": self.eval_wall,
                "evals": self.evals, "samples": self.samples, "last_val": list(self.last_val),
                "last_valid": list(self.last_valid), "spread": list(self.spread),
                "corrupt_skipped": self.corrupt_skipped, "config": to_dict(self.cfg)}

    def load_state(self, st: dict) -> None:
        """Back to the state ``st`` (a checkpoint or a commit) describes; counters of time
        and traffic stay as they are (the caller decides)."""
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict({"ref_n": st.get("world", self.world), **st})
        self.sampler.load_state_dict(st["sampler"])
        if st.get("scaler"):
            self.scaler.load_state_dict(st["scaler"])
        self.feed.reset()                # streamed: the workers restart at the loaded position
        self.feed.skipped = int(st.get("data_skipped", 0))   # the corrupt images skipped up to it
        self.aug_gen.set_state(st["aug_gen"])
        set_rng_state(st, self.dev)
        self.evals, self.samples, self.last_val = st["evals"], st["samples"], tuple(st["last_val"])
        self.spread = tuple(st.get("spread", self.spread))
        self.corrupt_skipped = int(st.get("corrupt_skipped", self.feed.skipped))
        self.last_valid = tuple(st.get("last_valid", self.last_valid))

    def save_ckpt(self, k: int, *, last: bool) -> None:
        """Write this rank's checkpoint of step ``k``. A failure must reach every rank, or the
        others would wait in the next collective until dist.timeout: after a ``last``
        checkpoint (the run's end, or a stop) no collective follows and the error is raised
        at once; otherwise it rides in this rank's slot row of the next outer step's sync,
        where every rank sees it and stops (``_on_sync``)."""
        try:
            checkpoint.save(self.run_dir, k, self.rank, self.state_dict(), self.cfg.run.keep)
        except OSError as e:
            done = checkpoint.latest_complete(self.run_dir, self.world)
            self.ckpt_error = (f"run.dir: rank {self.rank} cannot write checkpoint step {k} in "
                               f"{self.run_dir}/checkpoints ({e.strerror or e}); "
                               f"{_kept(done, sentence=False)}")
            if last:
                raise CheckpointError(self.ckpt_error) from None

    # ----------------------------------------------------------------------- the loop
    def loop(self) -> dict:
        """Outer steps ``self.k + 1 .. K``. Every rank makes the same collectives in the same
        order: one sync (or slot exchange) per outer step, one allreduce per evaluation."""
        cfg, K, opt, scaler = self.cfg, self.K, self.opt, self.scaler
        self.net.train()
        for k in range(self.k + 1, K + 1):
            plan = opt.next_plan()                      # rank 0's, received in an earlier sync
            for _ in range(plan.steps[self.rank]):      # L, or this replica's share (parle.balance)
                xb, yb = self.feed.next()               # this replica's next batch, on its device
                opt.zero_grad(set_to_none=True)
                loss = self._backward(k, xb, yb)
                opt.synchronize_gradients()             # dpsgd: averaged before the overflow check (all ranks reach this)
                scaler.step(opt, loss=loss)             # the last one: outer update, sync (all ranks reach this)
                scaler.update()
            self.samples += sum(plan.steps) * cfg.train.batch_size
            eval_now = k % self.eval_every_steps == 0 or k == K
            ckpt_now = bool(cfg.run.ckpt_every and k % cfg.run.ckpt_every == 0) or k == K
            if eval_now or ckpt_now or self.stop_ranks:
                opt.synchronize()                       # this step's own sync (overlap): all ranks reach this alike
            stop = bool(self.stop_ranks)
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
                self.member.commit_step(opt.last_rows)
        return self.finish()

    def _forward(self, net, x: torch.Tensor) -> torch.Tensor:
        """``net`` on a normalised batch, under autocast at train.precision."""
        if self.cfg.train.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.dev.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
            return net(x)

    def _eval_forward(self, net, x: torch.Tensor) -> torch.Tensor:
        """The evaluation's outputs, scored in model.dtype (a bf16 logit loses digits in a sum)."""
        out = self._forward(net, x)
        return out.to(self.dtype) if out.is_floating_point() and out.dtype != self.dtype else out

    def _backward(self, k: int, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one inner step's batch, in train.accum micro-batches whose
        gradients add up to the whole batch's (each loss weighted by its share of the
        examples); only the last one's backward averages gradients across ranks (dpsgd).
        Returns the batch's loss (unscaled)."""
        ds, A = self.ds, self.cfg.train.accum
        parts = list(zip(xb.tensor_split(A), yb.tensor_split(A))) if A > 1 else [(xb, yb)]
        total = None
        for i, (xm, ym) in enumerate(parts):
            with self.opt.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                with torch.autocast(self.dev.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
                    loss = self.obj.loss(self._forward(self.net, to_input(xm, ds.mean, ds.std, self.dtype)), ym)
                if A > 1:
                    loss = loss * (len(ym) / len(yb))
                if i == 0 and self.opt.j == 0 and _injected("PARLE_HVD_INJECT_INF", self.rank, k):
                    loss = loss * float("inf")        # tests: an overflow in outer step k's first inner step
                self.scaler.scale(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def _flags(self, k: int) -> dict:
        """This trainer's flags in its slot row of outer step k: a stop asked (a signal), a
        failed checkpoint write, and (elastic mode, rank 0) the coordinator's news of hosts
        leaving or joining, acted on at this step's commit."""
        hosts = self.member.hosts_pending() if self.member is not None and self.member.commit_due(k) else 0.0
        stop = self.stop.requested is not None or _injected("PARLE_HVD_INJECT_STOP", self.rank, k)
        return {"stop": stop, "ckpt": self.ckpt_error is not None, "hosts": hosts}

    def _on_sync(self, r: SyncReport) -> None:
        """After every sync, on every rank alike (the rows are the same): log the step, then
        stop all ranks together on a non-finite replica or a failed checkpoint write
        (raises), and note the ranks that asked for a stop."""
        rows = r.rows
        self.last_loss, self.loss_step = float(rows[:, 0].mean()), r.step
        self.perf[0] += 1000 * float(rows[:, COL["step_seconds"]].mean())
        self.perf[1] += 1
        if (self.rank == 0 or self.member is not None) and (r.step % self.log_every_steps == 0 or r.step == self.K):
            # rank 0 writes the row; in elastic mode every rank makes it (losses and plan the same
            # everywhere, timings its own): rank 0 may be lost after this step's commit, before it
            # writes the row, and the new rank 0 writes its own then
            self.last_row = (r.step, report.step_scalars(self, r))
            if self.rank == 0:
                self.log.scalars(*self.last_row)
        bad = [i for i in range(len(rows)) if rows[i, COL["nonfinite"]] > 0]
        if bad:
            last = checkpoint.latest_complete(self.run_dir, self.world)
            self.log.flush()
            raise DivergenceError(f"non-finite loss or weights on rank(s) {bad} at outer step {r.step}; stopped. "
                                  f"{_kept(last, self.run_dir)}")
        failed = [i for i in range(len(rows)) if rows[i, COL["ckpt"]] > 0]
        if failed:
            # the rank that failed raises its own message (printed by that rank); the others a
            # RunError (printed by rank 0) naming it
            self.log.flush()
            if self.ckpt_error is not None:
                raise CheckpointError(self.ckpt_error)
            done = checkpoint.latest_complete(self.run_dir, self.world)
            raise RunError(f"run.dir: rank(s) {failed} could not write their checkpoint (their message above); "
                           f"stopped after outer step {r.step}. {_kept(done, self.run_dir)}")
        self.stop_ranks.update(i for i in range(len(rows)) if rows[i, COL["stop"]] > 0)

    def _progress_text(self, k: int) -> str:
        """With parle.overlap the newest rows are the previous step's (none yet at step 1):
        the line says which step its loss is from rather than print a NaN."""
        loss = ("loss -" if self.loss_step is None else f"loss {self.last_loss:.3f}"
                + (f" (step {self.loss_step})" if self.loss_step != k else ""))
        return loss + (f" val {self.last_val[0]:.4f}" if self.evals else " val -")

    def _evaluate(self, k: int, plan) -> None:
        """Evaluate the reference (test, and validation with data.val_frac). All ranks reach this."""
        cfg, ds, t_eval = self.cfg, self.ds, time.monotonic()
        ref = self.opt.reference_model()          # all ranks reach this (a broadcast for sgd and dpsgd)
        with self.dog.collective("evaluation", k):
            recompute_bn(ref, ds, cfg.eval.bn_batches, cfg.train.batch_size, cfg.train.seed, k, self.dtype, self.dev,
                         forward=self._forward)
            # the reference's weights in the module that trains, so that a compiled one is
            # reused (a weight swap is no recompile; eval mode is one, at the first evaluation)
            with self.opt.reference(form=False):
                acc, vloss, drows, valid = evaluate(self.net, ds, self.rank, self.world, cfg.eval.batch_size,
                                                    self.dtype, self.dev, [self.opt.dist_prev, self.feed.skipped], self.obj,
                                                    forward=self._eval_forward)
        if self.opt.algo.syncs:
            self.spread = (float(drows[:, 0].mean()), float(drows[:, 0].max()))   # ||x_a - xbar|| now, every replica
        self.corrupt_skipped = int(drows[:, 1].sum())   # rides on the evaluation's allreduce: no collective of its own
        self.evals += 1
        self.eval_wall += time.monotonic() - t_eval
        self.last_val = (acc, vloss)
        if valid is not None:
            self.last_valid = valid
        scalars, line = report.evaluation(self, k, plan, acc, vloss, valid)
        self.log.scalars(k, scalars)
        self.log.info(line)
        graphs = report.compiled_graphs()
        if self.cfg.train.compile and self.evals > 1 and graphs != self.graphs_seen:
            self.log.info(f"compile: {graphs - self.graphs_seen} graph(s) recompiled since the last evaluation "
                          f"({graphs - self.graphs0} in all)")
        self.graphs_seen = graphs
        self.net.train()

    def _stopped(self, k: int) -> dict:
        self.feed.close()
        self.log.info(f"stopped after outer step {k} on a signal to rank(s) {sorted(self.stop_ranks)}; checkpoint written; "
                      f"resume with run.resume=true run.dir={self.run_dir}")
        self.log.close()
        return {"stopped_at": k, "run_dir": str(self.run_dir)}

    def finish(self) -> dict:
        self.feed.close()
        cfg, log, opt, cs, m = self.cfg, self.log, self.opt, comm.stats(), self.obj.metric
        summary = report.summary(self)
        wall = summary["wall_seconds"]
        if self.rank == 0:
            try:   # each written whole or not at all
                checkpoint.atomic_save(opt.ref_model.state_dict(), self.run_dir / "final.pt")
                checkpoint.atomic_write_text(self.run_dir / "final.json",
                                             json.dumps(inference_card(cfg, self.ds, m), indent=2))
                checkpoint.atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            except OSError as e:
                raise CheckpointError(f"run.dir: cannot write final.pt/summary.json in {self.run_dir} "
                                      f"({e.strerror or e}); the last complete checkpoint is kept") from None
            log.info(f"done: test {m} {self.last_val[0]:.4f}, {wall:.1f} s, {cs.allreduce_calls} allreduces, "
                     f"{cs.bytes / 1e6:.2f} MB; {self.run_dir}/summary.json")
        log.close()
        return summary


def train(cfg: Config, *, give_back_signals: bool = True) -> dict:
    """Run ``cfg`` on this rank; every rank calls this. Returns the summary (rank 0 also
    writes it to ``<run.dir>/summary.json``). The run installs its SIGTERM/SIGINT handlers
    (a stop after the next outer step) and gives the previous ones back when it returns or
    raises, unless ``give_back_signals=False`` (train.py, whose process ends right after)."""
    return Trainer(cfg, give_back_signals=give_back_signals).run()
