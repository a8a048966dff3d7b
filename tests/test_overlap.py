"""parle.overlap and parle.balance on 2 ranks: the overlapped outer update checked in
float64 against PARLE.md's formula written out by hand, one allreduce per outer step,
identical references on every rank, the same result as the blocking loop, and exact
resume after kill -9 with both on."""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from multirank import ROOT, RankJob, kill9_after_first_checkpoint, run_ranks, run_sweep
from parle_hvd import checkpoint
from parle_hvd.config import ParleConfig

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]
TRAIN = ROOT / "tests/ranks/train_rank.py"
CFG = ["--config", "configs/fashion_parle.yaml"]
SMALL = ["data.train_limit=2560", "data.test_limit=500", "parle.sync_period=5", "train.batch_size=64",
         "run.progress=lines", "eval.bn_batches=2", "dist.threads=1"]
MU = 0.9


def _dumps(d: Path, rank: int) -> list:
    files = sorted(d.glob(f"outer-rank{rank}-step*.pt"), key=lambda p: int(p.stem.split("step")[1]))
    return [torch.load(f) for f in files]


def _pull_by_hand(x, z, xbar, v, *, rk, lr):
    """PARLE.md's outer update, written out: d = (x - z) + rk (x - xbar); v = mu v + d;
    d = d + mu v (Nesterov); x = x - lr d."""
    d = (x - z) + rk * (x - xbar)
    v = MU * v + d
    return x - lr * (d + MU * v)


def test_overlapped_update_is_parle_md_in_float64_and_identical_to_blocking(tmp_path):
    # the blocking and the overlapped run in one start of the ranks (tests/ranks/sweep_rank.py),
    # each dumping its outer steps to its own folder
    dirs = {o: (tmp_path / f"run-{o}", tmp_path / f"dump-{o}") for o in (False, True)}
    for _, dump in dirs.values():
        dump.mkdir()
    run_sweep([[*CFG, *SMALL, "model.dtype=float64", "train.epochs=1", "eval.every=1", "run.ckpt_every=0",
                f"parle.overlap={str(o).lower()}", f"run.dir={run}"] for o, (run, _) in dirs.items()],
              run_env=[{"PARLE_HVD_DUMP_OUTER": str(dump)} for _, dump in dirs.values()], timeout=400)
    runs = {o: (json.loads((run / "summary.json").read_text()), dump, run) for o, (run, dump) in dirs.items()}
    s, dump, run = runs[True]
    K = s["outer_steps"]
    assert s["overlap"] is True and runs[False][0]["overlap"] is False
    # the sync of every step but the last (which evaluates and checkpoints: drained) was
    # waited for during the next step's inner loop
    assert s["overlapped_syncs"] == K - 1 and runs[False][0]["overlapped_syncs"] == 0
    # still exactly one allreduce per outer step (+1 first reference, +1 per evaluation)
    assert s["allreduce_calls"] == K + 1 + s["evaluations"] == runs[False][0]["allreduce_calls"]
    d0, d1 = _dumps(dump, 0), _dumps(dump, 1)
    assert [d["step"] for d in d0] == [d["step"] for d in d1] == list(range(1, K + 1))
    # each outer step used its own plan, not the one before or after: PARLE.md's rk at step k,
    # (1/rho0) (1 + s/nb)^k below its cap, different at every step of this run
    P, nb = ParleConfig(), json.loads((run / "run.json").read_text())["batches_per_pass"]
    for d in d0:
        want = min(P.rho0_inv * (1 + P.scoping / nb) ** d["step"], P.rho_min_inv)
        assert math.isclose(d["rk"], want, rel_tol=1e-12), (d["step"], d["rk"], want)
        assert d["lr"] == runs[False][0]["config"]["optim"]["lr"] and d["steps"] == (5, 5)
    assert len({d["rk"] for d in d0}) == K
    for k in range(K):
        a, b = d0[k], d1[k]
        # identical references on every rank, and rank 0's schedule on both
        assert all(torch.equal(u, w) for u, w in zip(a["xbar"], b["xbar"])), k
        assert (a["rk"], a["lr"]) == (b["rk"], b["lr"])
        if k > 0:
            # the reference pulled toward at step k+1 is the mean of the replicas after step k
            for u, p, q in zip(a["xbar"], d0[k - 1]["after"], d1[k - 1]["after"]):
                assert torch.allclose(u, (p + q) / 2, rtol=0, atol=1e-15), k
        for d in (a, b):
            assert d["after"][0].dtype == torch.float64
            for x, z, xb, v, out in zip(d["x"], d["z"], d["xbar"], d["v_out"], d["after"]):
                want = _pull_by_hand(x, z, xb, v, rk=d["rk"], lr=d["lr"])
                assert torch.allclose(out, want, rtol=0, atol=1e-12), k
    # the overlapped loop computes exactly what the blocking one does
    fa, fb = torch.load(run / "final.pt"), torch.load(runs[False][2] / "final.pt")
    assert all(torch.equal(fa[n], fb[n]) for n in fa)
    assert s["test_accuracy"] == runs[False][0]["test_accuracy"]


def test_exact_resume_after_kill9_with_overlap_and_balance(tmp_path):
    """Uninterrupted vs killed (SIGKILL, whole tree) after its first complete checkpoint and
    resumed, with parle.overlap and parle.balance=time; the replicas' speeds are reported as
    1 : 2 (PARLE_HVD_FAKE_STEP_SECONDS), so the assignments are deterministic: rank 1 takes
    about twice rank 0's inner steps, n*L in all."""
    common = [*CFG, *SMALL, "train.epochs=2", "run.ckpt_every=4", "eval.every=1", "run.log_every=1",
              "parle.overlap=true", "parle.balance=time"]
    env = {"PARLE_HVD_FAKE_STEP_SECONDS": "0.02,0.01"}
    a = tmp_path / "a"
    run_ranks(TRAIN, args=[*common, f"run.dir={a}"], timeout=240, reports=False, env=env)
    b = tmp_path / "b"
    job = RankJob([TRAIN, *common, f"run.dir={b}"], env=env)
    killed_at = kill9_after_first_checkpoint(job, b)
    s_a = json.loads((a / "summary.json").read_text())
    assert not (b / "summary.json").exists() and killed_at < s_a["outer_steps"]
    # the checkpoint keeps rank 0's plans for the steps after it, assignments included
    st = torch.load(checkpoint.step_dir(b, killed_at) / "rank-1.pt", weights_only=False)
    assert sorted(st["plans"]) == [killed_at + 1, killed_at + 2]
    out = run_ranks(TRAIN, args=[*common, f"run.dir={b}", "run.resume=true"], timeout=240, reports=False, env=env)
    assert "resumed from checkpoint step" in out[0]["_output"]
    s_b = json.loads((b / "summary.json").read_text())
    assert s_b["resumed_from"] >= killed_at and s_b["outer_steps"] == s_a["outer_steps"]
    fa, fb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert all(torch.equal(fa[n], fb[n]) for n in fa)
    assert s_a["test_accuracy"] == s_b["test_accuracy"] and s_a["allreduce_calls"] == s_b["allreduce_calls"]
    assert s_a["balance"] == "time" and s_a["overlap"] is True
    # every assignment is logged: n*L inner steps in all, each >= 1, the faster replica twice
    # the other's once the speeds are known (steps 1-2 were planned before any was measured)
    rows = [json.loads(l) for l in (a / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: (r["balance/inner_steps/0"], r["balance/inner_steps/1"]) for r in rows
             if "balance/inner_steps/0" in r}
    assert sorted(steps) == list(range(1, s_a["outer_steps"] + 1))
    assert all(p + q == 2 * 5 and min(p, q) >= 1 for p, q in steps.values())
    assert steps[1] == steps[2] == (5, 5)
    # step 3 ran the plan of sync 1 (made before any speed was known): sync 2, which carries
    # a new plan for step 3 as well, is waited for only after step 3's inner loop
    assert steps[3] == (5, 5), steps
    assert all(v == (3, 7) for k, v in steps.items() if k >= 4), steps
    assert s_a["samples_seen"] == s_a["outer_steps"] * 2 * 5 * 64


def test_stop_divergence_and_checkpoint_failure_with_overlap(tmp_path):
    """With parle.overlap a flag is read one outer step after it was sent. A stop asked on
    rank 1 in step 4 stops every rank after step 5, names rank 1, and resumes to the
    uninterrupted run's weights; a NaN on rank 1 in step 7 is named at step 7 (the
    checkpoint of step 6 kept); rank 1 unable to write step 2's checkpoint stops every rank
    after step 3 with its message. The progress line never shows a NaN loss."""
    common = [*CFG, *SMALL, "train.epochs=3", "eval.every=1", "run.log_every=1", "run.ckpt_every=3",
              "parle.overlap=true"]
    ref, d = tmp_path / "ref", tmp_path / "stop"
    # the uninterrupted run and the stopped one in one start of the ranks (tests/ranks/sweep_rank.py)
    out = run_sweep([[*common, f"run.dir={ref}"], [*common, f"run.dir={d}"]],
                    run_env=[None, {"PARLE_HVD_INJECT_STOP": "1:4"}], timeout=400)
    o = out[0]["_output"]
    assert "stopped after outer step 5 on a signal to rank(s) [1]" in o, o
    # (both runs' lines: the reference's and the stopped run's)
    assert o.count("step 1: loss - val -") >= 2 and not re.search(r"step \d+: loss nan", o), o
    assert checkpoint.latest_complete(d, 2) == 5 and not (d / "summary.json").exists()
    run_ranks(TRAIN, args=[*common, f"run.dir={d}", "run.resume=true"], timeout=240, reports=False)
    fa, fb = torch.load(ref / "final.pt"), torch.load(d / "final.pt")
    assert all(torch.equal(fa[n], fb[n]) for n in fa)
    s_a, s_b = (json.loads((x / "summary.json").read_text()) for x in (ref, d))
    assert (s_a["test_accuracy"], s_a["allreduce_calls"]) == (s_b["test_accuracy"], s_b["allreduce_calls"])

    d = tmp_path / "nan"
    out = run_ranks(TRAIN, args=[*common, f"run.dir={d}"], env={"PARLE_HVD_INJECT_NAN": "1:7"}, timeout=240,
                    reports=False, expect_fail=True)
    o = out[0]["_output"]
    assert out[0]["_rc"] != 0, o          # (3 from the rank; launch/local.sh passes it on, horovodrun says 1)
    assert "non-finite loss or weights on rank(s) [1] at outer step 7" in o and "(step 6) is kept" in o, o
    assert checkpoint.latest_complete(d, 2) == 6 and not checkpoint.step_dir(d, 7).exists()
    assert not (d / "summary.json").exists()

    d = tmp_path / "ckpt"
    out = run_ranks(TRAIN, args=[*common, "run.ckpt_every=2", f"run.dir={d}"], env={"PARLE_TEST_RANK1_FSIZE": "200000"},
                    timeout=240, reports=False, expect_fail=True)
    o = out[0]["_output"]
    assert out[0]["_rc"] != 0, o
    assert re.search(r"^\[1\](<stderr>)?:error: run.dir: rank 1 cannot write checkpoint step 2", o, re.M), o
    assert re.search(r"^\[0\](<stderr>)?:error: run.dir: rank\(s\) \[1\] could not write their checkpoint \(their "
                     r"message above\); stopped after outer step 3", o, re.M), o
    assert (checkpoint.step_dir(d, 2) / "rank-0.pt").is_file() and checkpoint.latest_complete(d, 2) is None
    assert "step None" not in o and "no complete checkpoint was written yet: nothing to resume from" in o, o
