"""Speed on accelerators, tested on the CPU (issue 24): gradient accumulation equals the
unaccumulated run (float64, Parle in one process and dpsgd on 2 ranks under both engines);
bf16 autocast trains and keeps fp32 master weights; fp16's GradScaler skips an injected
overflow as an inner step that updates nothing, and the run resumes bit-identically after
kill -9; a 2-rank bf16 Parle run keeps the allreduce count; a compiled model evaluates the
reference without a recompile per evaluation."""
import json
import os

import pytest
import torch

from multirank import ROOT, RankJob, kill9_after_first_checkpoint, run_ranks, run_sweep
from parle_hvd.config import make_config
from parle_hvd.trainer import train

USER = ROOT / "tests/user_code"
TRAIN = ROOT / "tests/ranks/train_rank.py"
ENV = {"PYTHONPATH": f"{USER}{os.pathsep}{ROOT}"}
FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION), reason="make setup installs dataset-fashion-mnist")
# An MLP without BatchNorm or dropout, on the user dataset of tests/user_code: a micro-batch
# then sees nothing but its examples, so accumulation can be exact.
MLP = ["model.target=usermods.nets:make_mlp", "model.kwargs={hidden: 16}", "data.target=tests/user_code/data.py:make",
       "data.kwargs={n_train: 512, n_test: 128, n_val: 64}", "train.batch_size=32", "parle.sync_period=4",
       "optim.schedule=constant", "eval.bn_batches=0", "run.progress=lines", "dist.threads=1", "run.tensorboard=false"]
SMALL = ["data.train_limit=1280", "data.test_limit=400", "parle.sync_period=5", "train.batch_size=64",
         "run.progress=lines", "eval.bn_batches=2", "dist.threads=1"]


def _one(tmp_path, name, *over):
    d = tmp_path / name
    cfg = make_config(None, ["dist.backend=none", f"run.dir={d}", *MLP, *over])
    return train(cfg), torch.load(d / "final.pt")


def _assert_close(a: dict, b: dict, tol: float):
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            assert torch.allclose(a[k], b[k], rtol=0, atol=tol), (k, (a[k] - b[k]).abs().max().item())
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("algo", [["algo=parle"], ["algo=entropy", "entropy.noise=1e-3"]])
def test_accumulated_micro_batches_equal_the_whole_batch_in_float64(tmp_path, monkeypatch, algo):
    """Parle in one process (its momentum, scoping and weight decay) and Entropy-SGD with
    Langevin noise, float64: accum=2 and 4 (micro-batches of 16 and 8) end with the
    weights of accum=1 to 1e-12, and the same test loss."""
    monkeypatch.syspath_prepend(str(USER))
    over = ["model.dtype=float64", "train.epochs=2", *algo]
    s1, w1 = _one(tmp_path, "a1", *over)
    for a in (2, 4):
        s, w = _one(tmp_path, f"a{a}", *over, f"train.accum={a}")
        assert s["accum"] == a and s["inner_steps"] == s1["inner_steps"]
        _assert_close(w1, w, 1e-12)
        assert s["test_loss"] == pytest.approx(s1["test_loss"], rel=1e-10)


@needs_fashion
def test_bf16_autocast_on_the_cpu_trains_and_keeps_fp32_master_weights(tmp_path):
    """LeNet on Fashion-MNIST under bf16 autocast with channels_last: it learns as fp32
    does (a short run), the weights it saves are float32, and summary.json reports what a
    GPU user watches."""
    common = ["train.epochs=1", "data.train_limit=1280", "data.test_limit=400", "train.batch_size=32",
              "parle.sync_period=5", "run.tensorboard=false"]
    out = {}
    for p in ("fp32", "bf16"):
        d = tmp_path / p
        cfg = make_config(None, ["dist.backend=none", f"run.dir={d}", "run.progress=lines", *common,
                                 f"train.precision={p}", f"train.channels_last={p == 'bf16'}"])
        out[p] = train(cfg), torch.load(d / "final.pt")
    s, w = out["bf16"]
    assert s["precision"] == "bf16" and s["skipped_steps"] == 0
    assert all(t.dtype == torch.float32 for t in w.values() if t.is_floating_point())
    assert s["test_accuracy"] > 0.6 and abs(s["test_accuracy"] - out["fp32"][0]["test_accuracy"]) < 0.08, \
        (s["test_accuracy"], out["fp32"][0]["test_accuracy"])
    assert s["step_ms"] > 0 and s["samples_per_sec_per_device"] > 0 and s["device_mem_gb"] == 0.0
    metrics = [json.loads(l) for l in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/step_ms" in m]
    assert steps and all(m["perf/step_ms"] > 0 and m["perf/samples_per_sec_per_device"] > 0 for m in steps)


@pytest.mark.multirank
@pytest.mark.parametrize("controller", [pytest.param("gloo", marks=pytest.mark.horovod), "torchrun"])
def test_dpsgd_accumulation_under_both_engines_equals_the_whole_batch(tmp_path, controller):
    """dpsgd on 2 ranks, float64: Horovod's DistributedOptimizer (backward_passes_per_step)
    and DDP (no_sync) average the accumulated gradients once per step, and accum=2 ends
    with the weights of accum=1 to 1e-12, with the same number of allreduce calls."""
    run_sweep([["--config", "configs/fashion_dpsgd.yaml", *MLP, "model.dtype=float64", "train.epochs=1",
                f"train.accum={a}", f"run.dir={tmp_path / f'a{a}'}"] for a in (1, 2)],
              controller=controller, env=ENV, timeout=180)       # the two runs as one job
    runs = {a: (json.loads((tmp_path / f"a{a}" / "summary.json").read_text()), torch.load(tmp_path / f"a{a}" / "final.pt"))
            for a in (1, 2)}
    _assert_close(runs[1][1], runs[2][1], 1e-12)
    assert runs[1][0]["allreduce_calls"] == runs[2][0]["allreduce_calls"]
    assert runs[2][0]["accum"] == 2


@pytest.mark.multirank
@needs_fashion
def test_two_rank_bf16_parle_keeps_one_allreduce_per_outer_step(tmp_path):
    """bf16 autocast with accumulation and channels_last changes nothing on the wire: the
    allreduce count is still outer steps + 1 + evaluations, and the references stay fp32."""
    d = tmp_path / "r"
    run_ranks(TRAIN, timeout=180, reports=False,
              args=["--config", "configs/fashion_parle.yaml", *SMALL, "train.epochs=1", "eval.every=0.5",
                    "train.precision=bf16", "train.accum=2", "train.channels_last=true", f"run.dir={d}"])
    s = json.loads((d / "summary.json").read_text())
    assert s["precision"] == "bf16" and s["evaluations"] == 2 and s["world_size"] == 2
    assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    assert all(t.dtype == torch.float32 for t in torch.load(d / "final.pt").values() if t.is_floating_point())


@pytest.mark.multirank
@needs_fashion
def test_fp16_skipped_step_counts_and_resumes_bit_identically_after_kill9(tmp_path):
    """fp16 with a GradScaler on 2 Parle ranks: an inf injected into rank 0's gradients at
    outer step 2 is skipped (skipped_steps = 1, the scale halved), and a run killed (-9)
    after its first checkpoint and resumed ends bit-identical to the uninterrupted one."""
    common = ["--config", "configs/fashion_parle.yaml", *SMALL, "train.epochs=1", "run.ckpt_every=3",
              "eval.every=1", "train.precision=fp16"]
    env = {"PARLE_HVD_INJECT_INF": "0:2"}
    a, b = tmp_path / "a", tmp_path / "b"
    run_ranks(TRAIN, timeout=180, reports=False, env=env, args=[*common, f"run.dir={a}"])
    job = RankJob([TRAIN, *common, f"run.dir={b}"], env=env)
    killed_at = kill9_after_first_checkpoint(job, b)
    s_a = json.loads((a / "summary.json").read_text())
    assert killed_at < s_a["outer_steps"] and not (b / "summary.json").exists()
    out = run_ranks(TRAIN, timeout=180, reports=False, env=env, args=[*common, f"run.dir={b}", "run.resume=true"])
    assert "resumed from checkpoint step" in out[0]["_output"]
    s_b = json.loads((b / "summary.json").read_text())
    assert s_a["skipped_steps"] == s_b["skipped_steps"] == 1     # rank 0's count (the summary's)
    ck = torch.load(sorted((a / "checkpoints").glob("step-*/rank-0.pt"))[-1], weights_only=False)
    assert ck["scaler"]["scale"] < 65536.0                        # the default initial scale, halved at least once
    fa, fb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert s_a["test_accuracy"] == s_b["test_accuracy"] and s_a["allreduce_calls"] == s_b["allreduce_calls"]


def test_compiled_model_evaluates_the_reference_without_a_recompile_per_evaluation(tmp_path, monkeypatch, capfd):
    """train.compile: one graph trains, one more evaluates (eval mode); three evaluations
    of the swapped-in reference add none, and the run logs no recompile."""
    monkeypatch.syspath_prepend(str(USER))
    s, _ = _one(tmp_path, "c", "train.epochs=1.5", "eval.every=0.5", "train.compile=true")
    assert s["evaluations"] == 3 and s["compile"] is True
    assert 1 <= s["compile_graphs"] <= 2, s["compile_graphs"]
    out = capfd.readouterr()
    assert "recompiled" not in out.out + out.err
