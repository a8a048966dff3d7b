"""Horovod elastic mode, for real: horovodrun --min-np/--max-np with a host discovery
script, each rank on its own "host" (tools/elasticlab.py: 127.0.0.x addresses in a private
network namespace, so Horovod blacklists one host when its rank dies, as on a cluster).

* Nobody lost: 3 ranks from start to end (the accuracy to compare with).
* One rank killed: the coordinator (rank 0) gets SIGKILL a third of the way in; the two
  others go on from the last commit without it, and finish with 2 ranks within 1 point
  of the unbroken run's test accuracy.
  Its 2-rank checkpoint then resumes with 3 ranks: the third starts at the reference.
* One rank joins: a host is added to the discovery file mid-run; its rank starts at the
  current reference and the run finishes with 3 ranks.
"""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from multirank import ROOT, VENV_BIN, kill_tree
from tools import elasticlab

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [
    pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist"),
    pytest.mark.skipif(elasticlab.available() is not None, reason=f"elastic lab: {elasticlab.available()}"),
    pytest.mark.multirank, pytest.mark.integration, pytest.mark.horovod,
]
# 75 outer steps of 5 inner steps (4 passes over 6000 examples), tested on all 10000 at outer
# steps 46 and 75 (eval.every=2.5: 46 steps; an evaluation on 3 ranks sharing 2 cores takes ~2 s).
ARGS = ["--config", "configs/fashion_parle.yaml", "data.train_limit=6000", "data.test_limit=0",
        "parle.sync_period=5", "train.batch_size=64", "train.epochs=4", "optim.milestones=[3]", "eval.every=2.5",
        "run.log_every=5", "run.progress=lines", "dist.threads=1", "dist.timeout=120"]
K = 75


def _step(run_dir: Path) -> int:
    """The outer step rank 0 is at (its heartbeat), 0 before the first."""
    try:
        return int((run_dir / ".heartbeat" / "rank-0").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _worker(lab, rank: int):
    """The training process Horovod started as ``rank`` (its rank at launch)."""
    for pid in lab.pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"HOROVOD_RANK={rank}".encode() in env and b"train.py" in cmd:
            return pid
    return None


def _elastic_run(tmp: Path, name: str, n_hosts: int, n_start: int, *, at_step: int = 0, action=None,
                 extra=(), timeout: float = 300, env_extra=None) -> tuple:
    """Run launch/elastic.sh in a lab of ``n_hosts`` hosts (the first ``n_start`` listed at the start);
    call ``action(lab, hosts_file)`` once rank 0 passes ``at_step``. Returns (rc, output,
    summary, run dir, what action returned)."""
    run_dir, hosts_file, out = tmp / name, tmp / f"{name}.hosts", tmp / f"{name}.out"
    with elasticlab.LoopbackHosts(n_hosts) as lab:
        hosts_file.write_text("".join(f"{h}:1\n" for h in lab.hosts[:n_start]))
        env = dict(os.environ, NP=str(n_start), MIN_NP="2", MAX_NP="3", PARLE_HVD_HOSTS_FILE=str(hosts_file),
                   ELASTIC_TIMEOUT="60", VENV=str(VENV_BIN.parent), **(env_extra or {}))
        with open(out, "w") as fh:
            proc = subprocess.Popen([*lab.prefix, "launch/elastic.sh", *ARGS, f"run.dir={run_dir}", *extra], cwd=ROOT,
                                    env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            acted, t0 = None, time.monotonic()
            try:
                while proc.poll() is None:
                    assert time.monotonic() - t0 < timeout, f"{name}: timed out\n{out.read_text()[-4000:]}"
                    if action and acted is None and _step(run_dir) >= at_step:
                        acted = action(lab, hosts_file) or True
                    time.sleep(0.2)
            finally:
                if proc.poll() is None:
                    kill_tree(proc.pid)
        # a worker may still be exiting the moment horovodrun returns (seen on a loaded machine)
        t1 = time.monotonic()
        while (left := lab.pids()) and time.monotonic() - t1 < 10:
            time.sleep(0.2)
    assert not left, f"{name}: processes left in the lab 10 s after the job ended: {left}"
    text = out.read_text()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None
    return proc.returncode, text, summary, run_dir, acted


def _train_steps(run_dir: Path) -> list:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "train/loss" in r]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    rc, out, s, d, _ = _elastic_run(tmp_path_factory.mktemp("elastic"), "unbroken", 3, 3)
    assert rc == 0 and s, out[-4000:]
    assert s["world_size"] == 3 and s["elastic_events"] == [] and s["outer_steps"] == K
    assert 0 < s["elastic_commit_seconds"] < s["wall_seconds"]
    print(f"elastic commits: {s['elastic_commit_seconds']:.3f} s of {s['wall_seconds']:.1f} s "
          f"({s['elastic_commit_seconds'] / s['wall_seconds']:.4f} of the run)")
    return s


def test_losing_the_coordinator_leaves_two_ranks_going_on_from_the_last_commit(tmp_path, unbroken):
    def kill_rank0(lab, hosts_file):
        pid = _worker(lab, 0)
        assert pid, "no rank 0 process"
        os.kill(pid, signal.SIGKILL)
        return _step(tmp_path / "kill")

    dump = tmp_path / "reform"
    dump.mkdir()
    # a survivor waiting on a live peer notices the loss at Horovod's Gloo timeout (30 s by
    # default): 10 s here. Horovod's background loops answer each other every few ms, so a
    # slow rank (loading, evaluating) never comes near it; it also bounds how far apart the
    # ranks may reach each rendezvous (hvd.init, a reset): they start together here.
    rc, out, s, d, killed_at = _elastic_run(tmp_path, "kill", 3, 3, at_step=25, action=kill_rank0,
                                            env_extra={"PARLE_HVD_DUMP_REFORM": str(dump),
                                                       "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"})
    assert killed_at and killed_at < K // 2, out[-4000:]
    assert rc == 0 and s, out[-4000:]
    # finished, with the two survivors, every outer step done once
    assert s["world_size"] == 2 and s["outer_steps"] == K, s
    assert _train_steps(d) == list(range(1, K + 1))       # the replayed stretch is logged once
    ev = s["elastic_events"]
    assert len(ev) == 1 and ev[0]["from"] == 3 and ev[0]["to"] == 2 and "failed" in ev[0]["why"], ev
    assert killed_at - 2 <= ev[0]["step"] <= killed_at + 1, (killed_at, ev)   # the last commit
    assert "back to the last commit: 3 -> 2 rank(s)" in out
    # the next outer step pulls toward the mean of the two survivors, not toward the committed
    # reference that still averaged in the lost replica
    assert "the reference re-formed from the 2 remaining replica(s)" in out
    dumps = [torch.load(f) for f in sorted(dump.glob("reform-rank*.pt"))]
    assert len(dumps) == 2 and all(x["member"] for x in dumps) and dumps[0]["step"] == ev[0]["step"], dumps
    for i in range(len(dumps[0]["ref"])):
        mean = (dumps[0]["model"][i].double() + dumps[1]["model"][i].double()) / 2
        for x in dumps:
            assert torch.allclose(x["ref"][i].double(), mean, rtol=0, atol=1e-6), i
        assert torch.equal(dumps[0]["ref"][i], dumps[1]["ref"][i])          # the same reference on both
    assert any(not torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(dumps[0]["before"], dumps[0]["ref"]))
    # the remaining replicas did not diverge: as good as the run that lost nobody
    print(f"test accuracy: lost rank 0 at step {killed_at}: {s['val_accuracy']:.4f}, "
          f"nobody lost: {unbroken['val_accuracy']:.4f}")
    assert abs(s["val_accuracy"] - unbroken["val_accuracy"]) <= 0.01, (s["val_accuracy"], unbroken["val_accuracy"])
    assert s["final_replica_distance"] == s["final_replica_distance"]          # finite, not NaN

    # Relaunch with 3 hosts and a fifth of a pass more (4 outer steps): the 2-rank checkpoint
    # resumes, the replicas it holds go on, and the third rank takes the free replica id (the
    # lost one's) at the reference.
    rc, out, s2, d2, _ = _elastic_run(tmp_path, "kill", 3, 3, extra=["run.resume=true", "train.epochs=4.2"])
    assert rc == 0 and s2, out[-4000:]
    assert f"resumed from checkpoint step {K} (written by 2 ranks)" in out
    assert s2["world_size"] == 3 and s2["resumed_from"] == K and s2["outer_steps"] > K, s2
    j = [e for e in s2["elastic_events"] if e.get("joined_ranks")]
    assert j[-1]["step"] == K and j[-1]["kept_ranks"] == [0, 1] and j[-1]["joined_replicas"] == [0], j
    assert f"joined at outer step {K} as replica 0, starting at the reference (||x - xbar|| = 0)" in out
    assert _train_steps(d2) == list(range(1, s2["outer_steps"] + 1))


def test_a_rank_that_joins_starts_at_the_current_reference(tmp_path, unbroken):
    def add_host(lab, hosts_file):
        hosts_file.write_text(hosts_file.read_text() + f"{lab.hosts[2]}:1\n")
        return _step(tmp_path / "join")

    rc, out, s, d, added_at = _elastic_run(tmp_path, "join", 3, 2, at_step=15, action=add_host)
    assert rc == 0 and s, out[-4000:]
    assert s["world_size"] == 3 and s["outer_steps"] == K, s
    joined = [e for e in s["elastic_events"] if e.get("joined_ranks")]
    assert len(joined) == 1, s["elastic_events"]
    j = joined[0]
    assert j["kept_ranks"] == [0, 1] and j["joined_ranks"] == [2] and j["joined_replicas"] == [2], j
    assert added_at <= j["step"] < K, (added_at, j)
    # the new replica's weights were the reference of that outer step, exactly
    assert f"joined at outer step {j['step']} as replica 2, starting at the reference (||x - xbar|| = 0)" in out
    assert _train_steps(d) == list(range(1, K + 1))
    print(f"test accuracy: rank joined at step {j['step']}: {s['val_accuracy']:.4f}, "
          f"3 ranks throughout: {unbroken['val_accuracy']:.4f}")
    assert abs(s["val_accuracy"] - unbroken["val_accuracy"]) <= 0.01
