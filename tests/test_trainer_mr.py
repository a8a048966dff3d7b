"""The trainer on 2 ranks under horovodrun (Gloo), mpirun and torchrun: identical
references after every sync, rank 0's schedule on every rank, exact communication counts,
exact resume after a kill -9 (by hand, and by torchrun's elastic agent), and a short real
training run."""
import json
import math
from pathlib import Path

import pytest
import torch

from multirank import ENGINE_OF, ROOT, RankJob, kill9_after_first_checkpoint, rank_process, run_ranks
from parle_hvd import checkpoint
from parle_hvd.parle import scoping

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]
TRAIN = ROOT / "tests/ranks/train_rank.py"
HVD = pytest.mark.horovod     # skipped where Horovod is not installed (conftest.py)
SMALL = ["data.train_limit=2560", "data.test_limit=1000", "parle.sync_period=5", "train.batch_size=64",
         "run.progress=lines", "eval.bn_batches=5"]


@HVD
def test_sync_exchange_mechanism():
    res = run_ranks(ROOT / "tests/ranks/exchange_check.py", controller="gloo", timeout=90)
    want = [[0.0123456789, 1.23456789, 0.1], [0.02, 1.5, 0.01]]
    for r, dtype in [(r, d) for r in res for d in ("torch.float32", "torch.float64")]:
        x = r[dtype]
        assert x["calls"] == 2                                              # one per sync
        assert x["ref"] == x["ref_async"] == [[0.5] * 6, [1.0] * 4]
        for got, w, steps in zip(x["plans"], want, [[5, 5], [3, 7]]):        # rank 0's, not rank 1's
            assert got[:3] == pytest.approx(w, rel=1e-14, abs=0) and got[3] == steps
        assert x["rows"] == [[1.5, 2.5, 10.0, 0.0, 0.0, 2.0, 0.0, 0.5], [2.5, 3.5, 20.0, 0.0, 1.0, 0.0, 1.0, 1.0]]
        assert x["model_untouched"]
        assert res[0][dtype]["plans"] == res[1][dtype]["plans"]            # bit-identical everywhere


@pytest.mark.parametrize("controller,init", [pytest.param("gloo", "independent", marks=HVD),
                                             pytest.param("mpi", "broadcast", marks=HVD),
                                             ("torchrun", "independent"), ("mpi-torch", "broadcast")])
def test_two_ranks_identical_reference_schedule_from_rank0_and_exact_counts(tmp_path, controller, init):
    run = tmp_path / "run"
    over = SMALL + [f"run.dir={run}", "train.epochs=1", "run.ckpt_every=1", "run.keep=1000", "eval.every=0.5",
                    f"parle.init={init}", "run.log_every=1",
                    "parle.gamma0_inv=0.2", "parle.rho0_inv=1.0", "parle.scoping=0.5"]
    out = run_ranks(TRAIN, controller=controller, args=["--config", "configs/fashion_parle.yaml", *over],
                    timeout=240, reports=False,
                    env={"PARLE_TEST_RANK1_OVERRIDES": "parle.gamma0_inv=0.9 parle.rho0_inv=7.0 optim.lr=0.5"})
    s = json.loads((run / "summary.json").read_text())
    nb = 2560 // 64
    K = math.ceil(nb / 5)
    assert s["world_size"] == 2 and s["engine"] == ENGINE_OF[controller] and s["outer_steps"] == K
    assert s["controller"] == (controller if s["engine"] == "horovod" else "gloo")
    # one fused allreduce per outer step, +1 for the first reference, +1 per evaluation
    assert s["evaluations"] == 2
    assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    assert "config differs from rank 0's" in out[0]["_output"]
    for k in range(1, K + 1):
        a = torch.load(checkpoint.step_dir(run, k) / "rank-0.pt", weights_only=False)
        b = torch.load(checkpoint.step_dir(run, k) / "rank-1.pt", weights_only=False)
        # every rank holds the identical reference after each sync ...
        for name in a["ref"]:
            assert torch.equal(a["ref"][name], b["ref"][name]), (k, name)
        # ... and the replicas themselves differ (independent seeds, own data order)
        assert not torch.equal(a["model"]["classifier.5.weight"], b["model"]["classifier.5.weight"])
        # rank 0's schedule for step k+1 reached rank 1, computed from rank 0's config
        assert a["sched"] == b["sched"]
        gk, rk = scoping(k + 1, gamma0_inv=0.2, gamma_min_inv=1.0, rho0_inv=1.0, rho_min_inv=10.0,
                         scoping=0.5, nb=nb)
        assert a["sched"][:2] == pytest.approx([gk, rk], rel=1e-12) and a["sched"][2] == pytest.approx(0.1)
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["comm/allreduce_calls"] == s["allreduce_calls"]
    dist = [l["parle/replica_distance"] for l in lines if "parle/replica_distance" in l]
    # distance at the start of step 1: independent inits differ, broadcast ones coincide
    if init == "independent":
        assert dist[0] > 1.0
    else:
        assert dist[0] == 0.0
    assert all(d > 0 for d in dist[1:])       # own data order: the replicas drift apart


def _final(run):
    return torch.load(run / "final.pt")


RESUME = SMALL + ["train.epochs=3", "run.ckpt_every=3", "eval.every=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the resume tests compare with, once per controller: run(controller) -> run dir."""
    done = {}

    def run(controller):
        if controller not in done:
            d = tmp_path_factory.mktemp(f"uninterrupted-{controller}") / "run"
            run_ranks(TRAIN, controller=controller, timeout=240, reports=False,
                      args=["--config", "configs/fashion_parle.yaml", *RESUME, f"run.dir={d}"])
            done[controller] = d
        return done[controller]
    return run


@pytest.mark.parametrize("controller", ["torchrun"])
def test_exact_resume_after_kill(tmp_path, uninterrupted, controller):
    """Uninterrupted run vs a run killed (SIGKILL, whole tree) right after its first
    complete checkpoint and resumed: identical final.pt tensors. (The same under
    horovodrun --gloo is the first of test_robustness.py's four kill -9 moments.)"""
    common = RESUME
    a = uninterrupted(controller)
    b = tmp_path / "b"
    job = RankJob([TRAIN, "--config", "configs/fashion_parle.yaml", *common, f"run.dir={b}"], controller=controller)
    killed_at = kill9_after_first_checkpoint(job, b)
    s_a = json.loads((a / "summary.json").read_text())
    assert not (b / "summary.json").exists() and killed_at < s_a["outer_steps"]
    out = run_ranks(TRAIN, controller=controller, args=["--config", "configs/fashion_parle.yaml", *common,
                                                        f"run.dir={b}", "run.resume=true"], timeout=240, reports=False)
    assert "resumed from checkpoint step" in out[0]["_output"]
    s_b = json.loads((b / "summary.json").read_text())
    assert s_b["resumed_from"] >= killed_at and s_b["outer_steps"] == s_a["outer_steps"]
    fa, fb = _final(a), _final(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert torch.equal(fa[k], fb[k]), k
    assert s_a["val_accuracy"] == s_b["val_accuracy"]
    assert s_a["allreduce_calls"] == s_b["allreduce_calls"]


def test_torchrun_elastic_agent_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    """dist.elastic under torchrun (--max-restarts 1): rank 1's worker is killed (SIGKILL)
    right after the first complete checkpoint; torchrun's agent restarts both workers, they
    resume from the newest complete checkpoint by themselves, and the run ends with the
    uninterrupted run's final weights, bit for bit."""
    import os
    import signal
    import time
    a = uninterrupted("torchrun")
    b = tmp_path / "b"
    job = RankJob([TRAIN, "--config", "configs/fashion_parle.yaml", *RESUME, f"run.dir={b}", "dist.elastic=true"],
                  controller="torchrun", launcher_args=["--max-restarts", "1"])
    t0 = time.monotonic()
    while checkpoint.latest_complete(b, 2) is None:
        assert job.proc.poll() is None and time.monotonic() - t0 < 180, job.output
        time.sleep(0.02)
    proc = rank_process(job, 1)
    assert proc is not None, job.output
    os.kill(proc.pid, signal.SIGKILL)
    assert job.wait(240) == 0, job.output
    s_a, s_b = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert s_b["resumed_from"] is not None and s_b["resumed_from"] >= 3, job.output
    assert [e["why"] for e in s_b["elastic_events"]] == ["torchrun restart"]
    assert s_b["outer_steps"] == s_a["outer_steps"] and s_b["val_accuracy"] == s_a["val_accuracy"]
    fa, fb = _final(a), _final(b)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.mark.integration
def test_short_real_training_run_learns(tmp_path):
    """One pass over the real Fashion-MNIST on 2 replicas: the reference learns."""
    run = tmp_path / "run"
    run_ranks(TRAIN, args=["--config", "configs/fashion_parle.yaml", "train.epochs=1", "eval.every=1",
                           f"run.dir={run}", "run.progress=lines"], timeout=300, reports=False)
    s = json.loads((run / "summary.json").read_text())
    assert s["val_accuracy"] >= 0.85, s["val_accuracy"]
    assert s["samples_seen"] == s["outer_steps"] * 25 * 128 * 2
    assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
