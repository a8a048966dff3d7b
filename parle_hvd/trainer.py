"""The Parle training loop: one MPI rank = one replica.

    horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
    mpirun -np 4 python train.py --config configs/fashion_parle.yaml parle.sync_period=50

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
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import random
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
from .data import ReplicaSampler, augment_batch, load_dataset, replica_indices, to_input, _gen
from .logger import RunLogger
from .models import build_model, sync_tensors
from .algorithms import ALGORITHMS
from .checkpoint import CheckpointError
from .watchdog import StopSignal, Watchdog
from .parle import lr_at, scoping

SLOT = ("loss", "loss_max", "distance", "nonfinite", "stop")   # one row per replica in every sync
SCHED = ("gk", "rk", "lr")                               # rank 0's values for the next step


class RunError(RuntimeError):
    """A problem with the run itself (directory, resume); one line, exit 2."""


class DivergenceError(RuntimeError):
    """Non-finite loss or weights; one line, exit 3, the last complete checkpoint kept."""


def _injected_nan(rank: int, step: int) -> bool:
    """Testing hook: PARLE_HVD_INJECT_NAN="<rank>:<outer step>" poisons that replica's
    weights after that outer step's inner loop (tests/test_robustness.py)."""
    v = os.environ.get("PARLE_HVD_INJECT_NAN", "")
    return v == f"{rank}:{step}"


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
    perm = torch.randperm(len(ds.train_x), generator=_gen(seed, 0xB4, step))
    for i in range(min(batches, len(perm) // batch_size or 1)):
        idx = perm[i * batch_size:(i + 1) * batch_size]
        ref(to_input(ds.train_x[idx].to(dev), ds.mean, ds.std, dtype))
    for m, mom in saved:
        m.momentum = mom
    ref.eval()


@torch.no_grad()
def evaluate(ref: nn.Module, ds, rank: int, world: int, batch_size: int, dtype, dev: torch.device, extra: list):
    """Test loss and accuracy of the reference, the test set sharded across ranks and the
    sums allreduced in float64 together with ``extra`` slot rows. All ranks reach this."""
    ref.eval()
    n = len(ds.test_x)
    lo, hi = (rank * n) // world, ((rank + 1) * n) // world
    correct = loss = 0.0
    for i in range(lo, hi, batch_size):
        x = to_input(ds.test_x[i:min(i + batch_size, hi)].to(dev), ds.mean, ds.std, dtype)
        y = ds.test_y[i:min(i + batch_size, hi)].to(dev)
        out = ref(x)
        loss += float(F.cross_entropy(out, y, reduction="sum"))
        correct += float((out.argmax(1) == y).sum())
    sums = torch.tensor([correct, loss, float(hi - lo)], dtype=torch.float64)
    rows = torch.zeros(world, len(extra), dtype=torch.float64)
    rows[rank] = torch.tensor(extra, dtype=torch.float64)
    comm.allreduce_sum_([sums, rows], name="eval")   # all ranks reach this
    c, l, cnt = sums.tolist()
    return c / cnt, l / cnt, rows


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


def resolve_run_dir(cfg: Config) -> Path:
    """Rank 0 only: the run directory, created and checked writable."""
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
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunError(f"run.dir: cannot write to {d} ({e.strerror or e})") from None
    return d


def _start(cfg: Config, rank: int) -> tuple[Config, Path, Optional[int]]:
    """Rank 0 resolves the run directory and the checkpoint to resume, and sends them and
    its config to every rank (one source of truth even if the ranks' configs differ)."""
    msg = None
    if rank == 0:
        try:
            d = resolve_run_dir(cfg)
            cfg.run.dir = str(d)
            step = None
            if cfg.run.resume:
                step = checkpoint.latest_complete(d, comm.size())
                if step is None:
                    raise RunError(f"run.resume: no complete checkpoint for {comm.size()} ranks in {d}/checkpoints")
            msg = {"cfg": cfg, "step": step}
        except RunError as e:
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
    return msg["cfg"], Path(msg["cfg"].run.dir), msg["step"]


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


# --------------------------------------------------------------------------- the loop
def train(cfg: Config) -> dict:
    comm.init(cfg.dist.backend, set_threads=cfg.dist.threads == 0, timeout=cfg.dist.timeout)
    if cfg.dist.threads:
        torch.set_num_threads(cfg.dist.threads)
    rank, world = comm.rank(), comm.size()
    stop = StopSignal(rank)
    stop.install()
    dog = Watchdog(cfg.dist.timeout, rank, world)
    if cfg.dist.expect_ranks and cfg.dist.expect_ranks != world:
        raise RunError(f"dist.expect_ranks: this config is meant for {cfg.dist.expect_ranks} ranks, "
                       f"launched with {world} (override dist.expect_ranks=0 to run anyway)")
    with dog.collective("start", 0):
        cfg, run_dir, resume_step = _start(cfg, rank)
    dog.attach(run_dir)
    P, O = cfg.parle, cfg.optim
    dtype = getattr(torch, cfg.model.dtype)
    dev = pick_device(cfg.dist.device)
    algo_cls = ALGORITHMS[cfg.algo]

    # Data: every replica holds the whole dataset in memory (uint8) and its own window/order;
    # data-parallel SGD gives each rank a disjoint shard instead.
    ds = load_dataset(cfg.data.name, cfg.data.dir, cfg.data.train_limit, cfg.data.test_limit, cfg=cfg.data)
    split, frac = (("frac", 1.0 / world) if algo_cls.shard_data and world > 1 else (cfg.data.split, cfg.data.frac))
    idx = replica_indices(len(ds.train_x), rank=rank, world=world, split=split, frac=frac, seed=cfg.train.seed)
    sampler = ReplicaSampler(idx, cfg.train.batch_size, seed=cfg.train.seed, rank=rank)
    nb = sampler.nb

    # Replica: independent initialisation (seed + rank) unless asked to start from rank 0's.
    torch.manual_seed(cfg.train.seed + rank)
    random.seed(cfg.train.seed + rank)
    np.random.seed((cfg.train.seed + rank) % 2**32)
    model = build_model(cfg.model.name, num_classes=ds.num_classes, in_channels=ds.shape[0],
                        image_size=ds.shape[1], dropout=cfg.model.dropout, depth=cfg.model.depth,
                        width=cfg.model.width).to(device=dev, dtype=dtype)
    if P.init == "broadcast" or algo_cls.same_init:
        with dog.collective("initial broadcast", 0):
            comm.broadcast_(list(model.state_dict().values()), name="init")   # all ranks reach this
    ref = copy.deepcopy(model)
    algo = algo_cls(model, cfg, world, rank)
    L = algo.L
    # The same on every rank: window sizes do not depend on the rank.
    K = max(1, math.ceil(cfg.train.epochs * nb / L))
    eval_every_steps = max(1, round(cfg.eval.every * nb / L))
    log_every_steps = max(1, math.ceil(cfg.run.log_every / L))
    model_t, ref_t = sync_tensors(model), sync_tensors(ref)
    ref_params = list(ref.parameters())
    ex = Exchange(world, rank, dtype)
    aug_gen = _gen(cfg.train.seed, rank, 0xA6)

    def schedule(k: int) -> tuple:                 # rank 0's, for algorithms that sync
        gk, rk = scoping(k, gamma0_inv=P.gamma0_inv, gamma_min_inv=P.gamma_min_inv, rho0_inv=P.rho0_inv,
                         rho_min_inv=P.rho_min_inv, scoping=P.scoping, nb=nb)
        lr = lr_at((k - 1) * L / nb, lr=O.lr, schedule=O.schedule, milestones=O.milestones, decay=O.decay,
                   total_passes=cfg.train.epochs, warmup_passes=O.warmup_passes)
        return gk, rk, lr

    header = {"config": to_dict(cfg), "versions": _versions(), "git_sha": _git_sha(), "world_size": world,
              "device": str(dev), "algo": cfg.algo,
              "controller": comm.controller(), "outer_steps": K, "inner_steps_per_outer": L, "batches_per_pass": nb,
              "params": sum(p.numel() for p in model.parameters()), "resumed_from": resume_step}
    # State carried across outer steps (and checkpoints).
    k0, wall_before, evals, samples, dist_prev = 0, 0.0, 0, 0, 0.0
    last_val = (float("nan"), float("nan"))
    spread = (float("nan"), float("nan"))
    if resume_step is not None:
        st = checkpoint.load(run_dir, resume_step, rank)
        if st.get("world") != world or st.get("params") != header["params"] or st.get("algo") != cfg.algo:
            raise RunError(f"run.resume: checkpoint step {resume_step} is for {st.get('algo')} on {st.get('world')} "
                           f"ranks with {st.get('params')} parameters; this run is {cfg.algo} on {world} ranks "
                           f"with {header['params']}")
        model.load_state_dict(st["model"]); ref.load_state_dict(st["ref"]); algo.load_state_dict(st["algo_state"])
        sampler.load_state_dict(st["sampler"]); aug_gen.set_state(st["aug_gen"])
        torch.set_rng_state(st["rng_torch"]); random.setstate(st["rng_py"]); np.random.set_state(st["rng_np"])
        if dev.type == "cuda" and st.get("rng_cuda") is not None:
            torch.cuda.set_rng_state(st["rng_cuda"])
        comm.load_stats(st["comm"])
        k0, sched, dist_prev = st["step"], tuple(st["sched"]), st["dist_prev"]
        wall_before, evals, samples, last_val = st["wall"], st["evals"], st["samples"], tuple(st["last_val"])

    # Only now, with the config and any checkpoint accepted, touch the run directory's files.
    log = RunLogger(run_dir, enabled=rank == 0, tensorboard=cfg.run.tensorboard, progress=cfg.run.progress,
                    total=K, start_step=resume_step or 0)
    dog.on_fail = log.flush
    if rank == 0:
        (run_dir / ("run.json" if resume_step is None else f"run-resume-{resume_step}.json")).write_text(
            json.dumps(header, indent=2))
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        log.info(f"parle_hvd: {cfg.algo}, {world} rank(s) [{comm.controller()}, {dev}], {K} outer steps of "
                 f"{L} inner steps, {nb} batches/pass, run dir {run_dir}")
        log.info(f"versions {header['versions']} git {header['git_sha'][:12]}")
        log.text("run", json.dumps(header, indent=2))

    if resume_step is not None:
        if rank == 0:
            checkpoint.discard_after(run_dir, resume_step)
            log.info(f"resumed from checkpoint step {resume_step}")
    elif algo.syncs:
        # The first reference, and rank 0's schedule for step 1. All ranks reach this.
        with dog.collective("first sync", 0):
            sched, _ = sync(model_t, ref_t, ex, schedule(1) if rank == 0 else None, {c: 0 for c in SLOT})
        dist_prev = replica_distance(model, ref)
        algo.after_sync(model_t, ref_t)
    else:
        sched = schedule(1)

    def save_ckpt(k: int) -> None:
        try:
            _save_ckpt(k)
        except OSError as e:
            last = checkpoint.latest_complete(run_dir, world)
            raise CheckpointError(f"run.dir: cannot write checkpoint step {k} in {run_dir}/checkpoints "
                                  f"({e.strerror or e}); the last complete checkpoint (step {last}) is kept") from None

    def _save_ckpt(k: int) -> None:
        state = {"step": k, "world": world, "params": header["params"], "algo": cfg.algo,
                 "model": model.state_dict(), "ref": ref.state_dict(), "algo_state": algo.state_dict(),
                 "sampler": sampler.state_dict(), "aug_gen": aug_gen.get_state(), "rng_torch": torch.get_rng_state(),
                 "rng_py": random.getstate(), "rng_np": np.random.get_state(),
                 "rng_cuda": torch.cuda.get_rng_state() if dev.type == "cuda" else None,
                 "comm": comm.stats().as_dict(), "sched": list(sched), "dist_prev": dist_prev,
                 "wall": wall_before + (time.monotonic() - t_start), "evals": evals, "samples": samples,
                 "last_val": list(last_val), "config": to_dict(cfg)}
        checkpoint.save(run_dir, k, rank, state, cfg.run.keep)

    t_start = time.monotonic()
    model.train()
    stopped_at = None
    for k in range(k0 + 1, K + 1):
        t_step = time.monotonic()
        gk, rk, lr = sched                          # rank 0's values, received at the last sync
        algo.begin_outer()
        losses = []
        for _ in range(L):                          # inner steps: no communication (but dpsgd's)
            b = sampler.next()
            xb = ds.train_x[b]
            if cfg.data.augment:
                xb = augment_batch(xb, aug_gen)
            out = model(to_input(xb.to(dev, non_blocking=True), ds.mean, ds.std, dtype))
            loss = F.cross_entropy(out, ds.train_y[b].to(dev, non_blocking=True))
            model.zero_grad(set_to_none=True)
            loss.backward()
            algo.inner_step(gk=gk, rk=rk, lr=lr, xbar=ref_params)
            losses.append(loss.detach())
        algo.end_outer(ref_params, rk=rk, lr=lr)    # parle: the elastic pull toward the reference
        if _injected_nan(rank, k):
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        lt = torch.stack(losses).double()
        finite = bool(torch.isfinite(lt).all()) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
        slot = {"loss": float(lt.mean()), "loss_max": float(lt.max()), "distance": dist_prev,
                "nonfinite": float(not finite), "stop": float(stop.requested is not None)}
        if algo.syncs:
            # One allreduce: the new reference, rank 0's schedule for step k+1, every replica's slot.
            with dog.collective("sync", k):
                sched, rows = sync(model_t, ref_t, ex, schedule(k + 1) if rank == 0 else None, slot)
            dist_prev = replica_distance(model, ref)
            algo.after_sync(model_t, ref_t)
        else:
            # Every rank computes the (deterministic) schedule; one small allreduce of the slots.
            sched = schedule(k + 1)
            with dog.collective("slots", k):
                rows = exchange_slots(slot, rank, world)
        samples += world * L * cfg.train.batch_size

        if rank == 0 and (k % log_every_steps == 0 or k == K):
            dt = time.monotonic() - t_step
            cs = comm.stats()
            sc = {"train/loss": rows[:, 0].mean(), "train/loss_max": rows[:, 0].max(),
                  "train/loss_max_inner": rows[:, 1].max(), "parle/lr": lr,
                  "comm/bytes": cs.bytes, "comm/allreduce_calls": cs.allreduce_calls,
                  "perf/samples_per_sec": world * L * cfg.train.batch_size / max(dt, 1e-9),
                  "train/passes": k * L / nb}
            if "gamma" in algo.couplings:
                sc.update({"parle/gamma": 1.0 / gk if gk > 0 else None, "parle/gamma_inv": gk})
            if "rho" in algo.couplings:
                sc.update({"parle/rho": 1.0 / rk if rk > 0 else None, "parle/rho_inv": rk})
            if algo.syncs:
                sc.update({"parle/replica_distance": rows[:, 2].mean(), "parle/replica_distance_max": rows[:, 2].max()})
            log.scalars(k, sc)
        if bool(rows[:, 3].any()):            # every rank sees the same rows: all stop here, together
            bad = [i for i in range(len(rows)) if rows[i, 3] > 0]
            last = checkpoint.latest_complete(run_dir, world)
            log.flush()
            raise DivergenceError(f"non-finite loss or weights on rank(s) {bad} at outer step {k}; stopped. "
                                  f"The last complete checkpoint (step {last}) is kept in {run_dir}/checkpoints")
        if bool(rows[:, 4].any()):
            stopped_at = k

        if (k % eval_every_steps == 0 or k == K) and stopped_at is None:
            with dog.collective("evaluation", k):
                algo.form_reference(model_t, ref_t)     # all ranks reach this (a no-op for syncing algorithms)
                recompute_bn(ref, ds, cfg.eval.bn_batches, cfg.train.batch_size, cfg.train.seed, k, dtype, dev)
                acc, vloss, drows = evaluate(ref, ds, rank, world, cfg.eval.batch_size, dtype, dev, [dist_prev])
            if algo.syncs:
                spread = (float(drows.mean()), float(drows.max()))   # ||x_a - xbar|| now, every replica
            evals += 1
            last_val = (acc, vloss)
            log.scalars(k, {"val/accuracy": acc, "val/loss": vloss, "val/error": 1 - acc,
                            "comm/allreduce_calls": comm.stats().allreduce_calls, "comm/bytes": comm.stats().bytes,
                            "train/passes": k * L / nb,
                            "train/wall_seconds": wall_before + (time.monotonic() - t_start)})
            log.info(f"step {k}/{K} pass {k * L / nb:.2f}: val acc {acc:.4f} loss {vloss:.4f}, "
                     f"train loss {float(rows[:, 0].mean()):.4f}, lr {lr:.3g}"
                     + (f" gamma_inv {gk:.3g}" if "gamma" in algo.couplings else "")
                     + (f" rho_inv {rk:.3g}" if "rho" in algo.couplings else ""))
            model.train()
        log.progress(k, f"loss {float(rows[:, 0].mean()):.3f} val {last_val[0]:.4f}")

        if (cfg.run.ckpt_every and k % cfg.run.ckpt_every == 0) or k == K or stopped_at is not None:
            save_ckpt(k)
        if stopped_at is not None:
            who = [i for i in range(len(rows)) if rows[i, 4] > 0]
            log.info(f"stopped after outer step {k} on a signal to rank(s) {who}; checkpoint written; "
                     f"resume with run.resume=true run.dir={run_dir}")
            log.close()
            return {"stopped_at": k, "run_dir": str(run_dir)}

    wall = wall_before + (time.monotonic() - t_start)
    cs = comm.stats()
    summary = {"val_accuracy": last_val[0], "val_loss": last_val[1], "wall_seconds": wall,
               "outer_steps": K, "inner_steps": K * L, "sync_period": L, "passes": K * L / nb,
               "evaluations": evals, "samples_seen": samples, "allreduce_calls": cs.allreduce_calls,
               "broadcast_calls": cs.broadcast_calls, "bytes_communicated": cs.bytes,
               "allreduce_bytes": cs.allreduce_bytes, "broadcast_bytes": cs.broadcast_bytes,
               "final_replica_distance": spread[0], "final_replica_distance_max": spread[1],
               "params": header["params"], "world_size": world, "algo": cfg.algo,
               "controller": comm.controller(), "device": str(dev), "resumed_from": resume_step,
               "config": to_dict(cfg)}
    if rank == 0:
        try:   # both written whole or not at all
            checkpoint.atomic_save(ref.state_dict(), run_dir / "final.pt")
            checkpoint.atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
        except OSError as e:
            raise CheckpointError(f"run.dir: cannot write final.pt/summary.json in {run_dir} ({e.strerror or e}); "
                                  f"the last complete checkpoint is kept") from None
        log.info(f"done: val accuracy {last_val[0]:.4f}, {wall:.1f} s, {cs.allreduce_calls} allreduces, "
                 f"{cs.bytes / 1e6:.2f} MB; {run_dir}/summary.json")
    log.close()
    return summary
