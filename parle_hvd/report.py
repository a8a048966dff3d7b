"""What a run reports, from a ``Trainer`` (``t``) as it stands: the header of run.json,
the scalars of an outer step (TensorBoard, metrics.jsonl) and the summary of summary.json.
Pure reading: nothing here changes the run or communicates."""
from __future__ import annotations

from . import comm
from .config import to_dict
from .exchange import SLOT
from .rundir import git_sha, versions

COL = {c: i for i, c in enumerate(SLOT)}


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (Dynamo's own counter): one
    for training, one more for eval mode; every later one is a recompile."""
    import torch._dynamo.utils as du   # torch.optim imported Dynamo already (cheap here)
    return int(du.counters["stats"]["unique_graphs"])


def device_mem_gb(dev) -> float:
    """Peak memory allocated on ``dev`` so far, GB (CUDA only; 0 elsewhere)."""
    import torch
    return torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else 0.0


def run_header(t) -> dict:
    cfg = t.cfg
    return {"config": to_dict(cfg), "versions": versions(), "git_sha": git_sha(), "world_size": t.world,
            "device": str(t.dev), "algo": cfg.algo, "elastic": cfg.dist.elastic, "engine": comm.engine(),
            "controller": comm.controller(), "outer_steps": t.K, "inner_steps_per_outer": t.L,
            "overlap": t.opt.overlap, "balance": "time" if t.opt.balance else "off",
            "batches_per_pass": t.nb, "params": t.n_params, "resumed_from": t.resumed_from}


def step_scalars(t, r) -> dict:
    """Outer step ``r.step``'s scalars from its sync report ``r`` (optim.SyncReport)."""
    rows, plan, algo, cs = r.rows, r.plan, t.opt.algo, comm.stats()
    sc = {"train/loss": rows[:, 0].mean(), "train/loss_max": rows[:, 0].max(),
          "train/loss_max_inner": rows[:, 1].max(), "parle/lr": plan.lr,
          "comm/bytes": cs.bytes, "comm/allreduce_calls": cs.allreduce_calls,
          "perf/samples_per_sec": sum(plan.steps) * t.cfg.train.batch_size / max(r.seconds, 1e-9),
          "perf/step_seconds": r.seconds, "train/passes": r.step * t.L / t.nb,
          # mean over replicas of one inner step's milliseconds (forward, backward, update)
          "perf/step_ms": 1000 * rows[:, COL["step_seconds"]].mean(),
          "perf/device_mem_gb": device_mem_gb(t.dev)}
    sc["perf/samples_per_sec_per_device"] = sc["perf/samples_per_sec"] / t.world
    if t.opt.balance:                 # what each replica did in step k, and how fast
        sc.update({f"balance/inner_steps/{a}": n for a, n in enumerate(plan.steps)})
        sc.update({f"balance/step_seconds/{a}": v for a, v in enumerate(rows[:, COL["step_seconds"]].tolist())})
    if t.member is not None:
        sc["dist/world_size"] = t.world
    if "gamma" in algo.couplings:
        sc.update({"parle/gamma": 1.0 / plan.gk if plan.gk > 0 else None, "parle/gamma_inv": plan.gk})
    if "rho" in algo.couplings:
        sc.update({"parle/rho": 1.0 / plan.rk if plan.rk > 0 else None, "parle/rho_inv": plan.rk})
    if algo.syncs:
        sc.update({"parle/replica_distance": rows[:, COL["distance"]].mean(),
                   "parle/replica_distance_max": rows[:, COL["distance"]].max()})
    return sc


def summary(t) -> dict:
    """summary.json. val_accuracy/val_loss: the test set (the historical names); valid_*: the
    held-out validation split of the training set (data.val_frac; NaN without one). With
    eval.metric other than accuracy: test_<metric>, valid_<metric>, no *_accuracy."""
    cfg, opt, cs, m = t.cfg, t.opt, comm.stats(), t.obj.metric
    figures = {f"val_{m}": t.last_val[0]} if m == "accuracy" else {}
    figures.update({"val_loss": t.last_val[1], f"test_{m}": t.last_val[0], "test_loss": t.last_val[1],
                    f"valid_{m}": t.last_valid[0], "valid_loss": t.last_valid[1]})
    return {"metric": m, **figures, "wall_seconds": t.wall(), "eval_seconds": t.eval_wall,
            "outer_steps": t.K, "inner_steps": t.K * t.L, "sync_period": t.L,
            "passes": t.K * t.L / t.nb, "overlap": opt.overlap,
            "balance": "time" if opt.balance else "off", "overlapped_syncs": opt.overlapped_syncs,
            "evaluations": t.evals, "samples_seen": t.samples, "allreduce_calls": cs.allreduce_calls,
            "broadcast_calls": cs.broadcast_calls, "bytes_communicated": cs.bytes,
            "allreduce_bytes": cs.allreduce_bytes, "broadcast_bytes": cs.broadcast_bytes,
            "final_replica_distance": t.spread[0], "final_replica_distance_max": t.spread[1],
            "params": t.n_params, "world_size": t.world, "algo": cfg.algo,
            "engine": comm.engine(), "controller": comm.controller(), "device": str(t.dev),
            "resumed_from": t.resumed_from,
            "data_streamed": t.ds.streamed, "data_workers": cfg.data.workers if t.ds.streamed else 0,
            "data_worker_start": t.ds.context if t.ds.streamed and cfg.data.workers else None,
            "data_corrupt_skipped": t.corrupt_skipped,
            "precision": cfg.train.precision, "accum": cfg.train.accum, "compile": cfg.train.compile,
            "channels_last": cfg.train.channels_last, "skipped_steps": opt.skipped_steps,
            "step_ms": t.perf[0] / max(t.perf[1], 1),
            "samples_per_sec_per_device": t.samples / max(t.wall(), 1e-9) / t.world,
            "device_mem_gb": device_mem_gb(t.dev), "compile_graphs": compiled_graphs() - t.graphs0 if cfg.train.compile else 0,
            "elastic": cfg.dist.elastic, "elastic_events": t.member.events if t.member else [],
            "elastic_commit_seconds": t.member.commit_seconds if t.member else 0.0,
            "config": to_dict(cfg)}


def evaluation(t, k: int, plan, acc: float, vloss: float, valid) -> tuple[dict, str]:
    """An evaluation of the reference at outer step k: its scalars (val/*: the test set;
    valid/*: the validation split) and its log line. The metric is accuracy, loss,
    perplexity or the user's (eval.metric)."""
    passes, m = k * t.L / t.nb, t.obj.metric
    sc = {f"val/{m}": acc, "val/loss": vloss,
          "comm/allreduce_calls": comm.stats().allreduce_calls, "comm/bytes": comm.stats().bytes,
          "train/passes": passes, "train/wall_seconds": t.wall(), "train/eval_seconds": t.eval_wall}
    if m == "accuracy":
        sc["val/error"] = 1 - acc
    if valid is not None:
        sc.update({f"valid/{m}": valid[0], "valid/loss": valid[1]})
        if m == "accuracy":
            sc["valid/error"] = 1 - valid[0]
    short, couplings = "acc" if m == "accuracy" else m, t.opt.algo.couplings
    line = (f"step {k}/{t.K} pass {passes:.2f}: "
            + (f"valid {short} {valid[0]:.4f}, " if valid is not None else "")
            + f"test {short} {acc:.4f} loss {vloss:.4f}, train loss {t.last_loss:.4f}, lr {plan.lr:.3g}"
            + (f" gamma_inv {plan.gk:.3g}" if "gamma" in couplings else "")
            + (f" rho_inv {plan.rk:.3g}" if "rho" in couplings else "")
            + (f", {t.world} ranks" if t.member is not None else ""))
    return sc, line
