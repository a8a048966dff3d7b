"""Elastic mode (``dist.elastic``): Horovod's elastic membership around the trainer's loop,
or (``dist.engine=torch``) torchrun's restart-based one.

Not to be confused with Elastic-SGD, the algorithm (easgd.py): here "elastic" is
Horovod's word for a world whose ranks may fail, leave or join while the job runs.

    horovodrun --gloo -np 3 --min-np 2 --max-np 4 --host-discovery-script launch/discover_hosts.sh \\
        python train.py --config configs/fashion_parle.yaml --elastic          # launch/elastic.sh

Horovod's ``elastic.run`` calls ``Trainer.loop``. At the end of an outer step every
``dist.elastic_commit_every`` steps, each rank commits its state (the checkpoint dict) to
host memory. When a rank fails, the others go back to their last commit in a smaller
world; a rank that joins builds a replica and starts it at the reference; when replicas
are lost the reference is re-formed from those that remain. docs/robustness.md, "Elastic
mode", has the details and what is tested.

Under torchrun (``restarts=True``) there is no membership change inside a job: torchrun's
elastic agent (``--nnodes=MIN:MAX --max-restarts=N``) restarts every worker when one fails
or a node joins or leaves, and each restart resumes from the newest complete checkpoint,
whatever number of ranks wrote it. ``sync`` does the same as at Horovod's start: replicas
in the checkpoint go on, a rank beyond them starts at the reference, and a reference that
averaged lost replicas is re-formed from those that remain. A failure replays from the
last checkpoint (``run.ckpt_every``), not from a commit in memory.
"""
from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch

from . import checkpoint, comm
from .exchange import replica_distance


def host_copy(obj):
    """A deep copy with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def run_torchrun_elastic(t) -> dict:
    """torchrun's elastic agent restarts every worker after a failure or a change of nodes;
    a restart resumes from the newest complete checkpoint in the run directory (which, with
    run.dir unset, is named after the rendezvous id, the same in every restart), whatever
    number of ranks wrote it."""
    from .rundir import RunError
    cfg = t.cfg
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        raise RunError("dist.elastic with dist.engine=torch: start the job with torchrun "
                       "(launch/torchrun.sh: --nnodes=MIN:MAX --max-restarts=N)")
    if not cfg.run.dir:
        cfg.run.dir = str(Path("runs") / f"{cfg.run.name}-torchrun-{run_id}")
    if comm.restart_count() and checkpoint.latest_complete_any(Path(cfg.run.dir)) is not None:
        cfg.run.resume = True          # rank 0's view decides (start_run sends its config)
    t.member = Membership(t, restarts=True)
    return t.member.run()


class Membership:
    """Horovod's elastic State for one rank's ``Trainer`` (``t``): its save/restore/sync/reset
    callbacks, and the commit at the end of an outer step (``commit_step``)."""

    def __init__(self, trainer, restarts: bool = False):
        self.t = trainer
        self.restarts = restarts     # torchrun's agent: no commits, no in-job changes
        self.committed = None        # this rank's last commit
        self.committed_row = None    # the metrics row of the committed step, if it was a logged one
        self.events: list = []       # every change of the world, for the summary
        self.commit_seconds = 0.0    # time spent committing (this process)
        self.restored = False
        self.removal_only = False    # the interrupt in flight removes hosts only (no sync follows)
        self.state = None if restarts else comm.elastic_state(save=self.commit, restore=self.restore, sync=self.sync,
                                                              reset=self.on_reset)

    def run(self) -> dict:
        if self.restarts:
            self.sync()                # all ranks reach this
            if comm.restart_count():
                self.events.append({"step": self.t.k, "world": self.t.world, "why": "torchrun restart",
                                    "restart": comm.restart_count(), "checkpoint_world": self.t.ckpt_world})
            return self.t.loop()
        return comm.elastic_run(lambda state: self.t.loop(), self.state)

    # ----------------------------------------------------------------------- in the loop
    def commit_due(self, k: int) -> bool:
        return not self.restarts and (k % self.t.cfg.dist.elastic_commit_every == 0 or k == self.t.K)

    def hosts_pending(self) -> float:
        """Rank 0's news from the coordinator of hosts leaving or joining (its slot row)."""
        return float(self.state.host_update_pending()) if self.t.rank == 0 and self.state else 0.0

    def commit_step(self, rows) -> None:
        """Commit, then leave for a re-formed world if the coordinator heard of host
        changes (rows are the same on every rank: all leave at this step). Horovod runs no
        state sync after a removal alone (update == 1): ``on_reset`` then re-forms the
        reference itself."""
        update = int(rows[:, 5].sum())
        self.removal_only = update == 1
        self.state.commit(update)

    # ----------------------------------------------------------------------- Horovod's callbacks
    def commit(self) -> None:
        """Horovod's State.save: keep a copy of this rank's state in host memory (not on
        the GPU, where it would double the model's footprint)."""
        if self.t.built:
            t0 = time.monotonic()
            self.committed = host_copy(self.t.state_dict())     # (waits for any sync in flight)
            row = self.t.last_row
            self.committed_row = row if row is not None and row[0] == self.t.k else None
            self.commit_seconds += time.monotonic() - t0

    def restore(self) -> None:
        """Horovod's State.restore, after a rank failed: back to the last commit."""
        if self.committed is not None:
            self.t.load_state(copy.deepcopy(self.committed))   # a copy: optimizers may alias what they load
            self.restored = True

    def on_reset(self) -> None:
        """Horovod re-formed the world (a rank left or joined): new ranks, new sizes."""
        t = self.t
        old = t.world
        t.rank, t.world = comm.rank(), comm.size()
        t.stop.rank = t.rank
        t.dog.reset(t.rank, t.world)
        if t.cfg.dist.threads == 0:
            comm.set_threads_per_rank()
        if not t.built:
            return
        t.opt.resize(t.world, t.rank)
        t.open_log(t.k)
        if self.committed_row is not None and self.committed_row[0] == t.k:
            t.log.ensure_row(*self.committed_row)    # the lost rank 0 may have died before writing it
        why = "a rank failed; back to the last commit" if self.restored else "hosts changed"
        t.log.info(f"elastic: {why}: {old} -> {t.world} rank(s) after outer step {t.k}")
        self.events.append({"step": t.k, "from": old, "to": t.world, "why": why})
        if self.removal_only and not self.restored and t.world < t.opt.ref_n and t.opt.algo.ref_is_mean:
            # no state sync follows a removal alone: every rank here holds a replica
            self.reform_reference([True] * t.world)     # all ranks reach this
        self.restored = self.removal_only = False

    def reform_reference(self, members: list) -> None:
        """After replicas were lost: the reference becomes the mean of the replicas that
        remain (``members[r]``: rank r holds one), not the committed reference that still
        averages in the lost ones. One fused allreduce: members send their weights and
        BatchNorm buffers, the other ranks (joiners, not yet started) zeros. All ranks reach this."""
        t = self.t
        mine, n = members[t.rank], sum(members)
        dump = os.environ.get("PARLE_HVD_DUMP_REFORM")        # testing hook (tests/test_elastic.py)
        before = [x.clone() for x in t.opt.ref_t] if dump else None
        with torch.no_grad():
            for r_, m in zip(t.opt.ref_t, t.opt.model_t):
                r_.copy_(m) if mine else r_.zero_()
        with t.dog.collective("elastic reference re-formed", t.k):
            comm.allreduce_sum_(t.opt.ref_t, name="elastic.reform")     # all ranks reach this
        with torch.no_grad():
            for r_ in t.opt.ref_t:
                r_.div_(n)
        t.opt.ref_n = n
        if mine:
            t.opt.dist_prev = replica_distance(t.opt.algo.anchor(), t.opt.ref_params)
        if t.log is not None:
            t.log.info(f"elastic: the reference re-formed from the {n} remaining replica(s) at outer step {t.k}")
        if dump:
            torch.save({"ref": [x.clone() for x in t.opt.ref_t], "model": [x.clone() for x in t.opt.model_t],
                        "before": before, "member": mine, "step": t.k, "replica": t.replica_id},
                       Path(dump) / f"reform-rank{t.rank}-step{t.k}.pt")

    def sync(self) -> None:
        """Horovod's State.sync, at the start and after every reset but a removal alone.
        Replicas that were committed at the newest step keep their own state; the lowest
        such rank (the root) sends the run's state and the reference; every other rank (a
        new one, or one left behind) builds a replica and starts it at the reference. The
        first time, no rank holds a replica and this is ``Trainer.start()``. All ranks reach this."""
        t = self.t
        rank, world = t.rank, t.world
        rows = torch.zeros(world, 3, dtype=torch.float64)
        if self.committed is not None:
            rows[rank] = torch.tensor([1.0, float(t.replica_id), float(t.k)], dtype=torch.float64)
        with t.dog.collective("elastic members", t.k if t.built else 0):
            comm.allreduce_sum_([rows], name="elastic.members")       # all ranks reach this
        holders = [r for r in range(world) if rows[r, 0] > 0]
        if not holders:
            t.start()
            self.commit()
            if t.ckpt_world < world:       # resumed with more ranks than wrote the checkpoint
                self.sync()                # all ranks reach this: the others start at the reference
            return
        k_new = max(int(rows[r, 2]) for r in holders)
        keep = [r for r in holders if int(rows[r, 2]) == k_new]
        root, mine = keep[0], rank in keep
        msg = None
        if rank == root:
            msg = {"cfg": t.cfg, "run_dir": str(t.run_dir), "world0": t.world0, **t.run_state(),
                   "comm": comm.stats().as_dict(), "events": self.events}
        with t.dog.collective("elastic run state", k_new):
            msg = comm.broadcast_object(msg, root=root, name="elastic.run")   # all ranks reach this
        taken = {int(rows[r, 1]) for r in keep}
        new = [r for r in range(world) if r not in keep]
        free = [i for i in range(world + len(taken)) if i not in taken][:len(new)]
        if not mine:
            t.cfg, t.run_dir = msg["cfg"], Path(msg["run_dir"])
            t.dog.attach(t.run_dir)
            t.build(free[new.index(rank)], msg["world0"], init_bcast=False)
        shared = t.opt.algo.shared_tensors()
        with t.dog.collective("elastic reference", k_new):
            comm.broadcast_(t.opt.ref_t + shared, root=root, name="elastic.ref")   # all ranks reach this
        if t.opt.algo.ref_is_mean and len(keep) < msg["ref_n"]:
            # replicas were lost: the reference is re-formed from the ones kept (before any
            # new replica starts at it). Every rank sees the same rows and msg: all reach this.
            self.reform_reference([r in keep for r in range(world)])
        if not mine:
            with torch.no_grad():
                for m, r in zip(t.opt.model_t, t.opt.ref_t):
                    m.copy_(r)                      # the new replica starts at the current reference
            t.load_run_state(msg)
            t.t_start = time.monotonic()
            t.opt.dist_prev = replica_distance(t.opt.algo.anchor(), t.opt.ref_params)
            comm.load_stats(msg["comm"])
            self.events = list(msg["events"])
            print(f"[rank {rank}] elastic: joined at outer step {t.k} as replica {t.replica_id}, "
                  f"starting at the reference (||x - xbar|| = {t.opt.dist_prev:.3g})", file=sys.stderr, flush=True)
            t.open_log(t.k)
        if new:
            self.events.append({"step": t.k, "world": world, "kept_ranks": keep, "joined_ranks": new,
                                "joined_replicas": free})
        t.log.info(f"elastic: {world} rank(s) at outer step {t.k}: {len(keep)} replica(s) kept, "
                   f"{len(new)} started at the reference (replica ids {free})")
        self.commit()
