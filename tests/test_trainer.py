"""The trainer in one process: the Entropy-SGD special case against a float64 loop that
follows PARLE.md, run outputs, and the exact-resume of a single replica."""
import json
import math
from pathlib import Path

import pytest
import torch

from parle_hvd.config import make_config
from parle_hvd.data import ReplicaSampler, load_dataset, replica_indices, to_input
from parle_hvd.models import build_model
from parle_hvd.trainer import train

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")


def _cfg(tmp_path, *over):
    return make_config(None, ["dist.backend=none", f"run.dir={tmp_path}", "run.progress=lines",
                              "run.tensorboard=false", *over])


@needs_fashion
def test_entropy_sgd_special_case_matches_float64_reference_loop(tmp_path):
    """1 replica (Entropy-SGD without noise), float64, 3 outer steps: the trainer's weights
    equal a loop written from PARLE.md to 1e-10."""
    L, bs, lr, g0, gmax, s, wd, mu, alpha = 4, 32, 0.05, 0.3, 1.0, 0.5, 1e-3, 0.9, 0.75
    n_train = 320   # nb = 10 batches per pass; 3 outer steps = 12 inner steps
    K = 3
    cfg = _cfg(tmp_path, "model.dtype=float64", "model.dropout=0.0", f"parle.sync_period={L}",
               f"train.batch_size={bs}", f"data.train_limit={n_train}", "data.test_limit=200",
               f"train.epochs={K * L / (n_train // bs)}", f"optim.lr={lr}", "optim.schedule=constant",
               f"optim.weight_decay={wd}", f"parle.gamma0_inv={g0}", f"parle.gamma_min_inv={gmax}",
               f"parle.scoping={s}", "eval.bn_batches=0", "run.ckpt_every=0")
    summary = train(cfg)
    assert summary["outer_steps"] == K and summary["world_size"] == 1
    got = torch.load(tmp_path / "final.pt")

    # ---- the reference loop, independent of parle_hvd.parle
    ds = load_dataset("fashion-mnist", "", n_train, 200)
    torch.manual_seed(42)
    model = build_model("lenet", num_classes=10, in_channels=1, dropout=0.0).to(torch.float64)
    names = [n for n, _ in model.named_parameters()]
    x = [p.detach().clone() for p in model.parameters()]
    v_in = [torch.zeros_like(t) for t in x]
    v_out = [torch.zeros_like(t) for t in x]
    sampler = ReplicaSampler(replica_indices(n_train, rank=0, world=1, split="full", frac=1.0, seed=42),
                             bs, seed=42, rank=0)
    nb = sampler.nb
    model.train()
    for k in range(1, K + 1):
        gk = min(g0 * (1 + s / nb) ** k, gmax)
        # n = 1: xbar = x, the elastic term is zero whatever rk is
        y = [t.clone() for t in x]
        z = [t.clone() for t in x]
        for _ in range(L):
            b = sampler.next()
            yp = {n: t.clone().requires_grad_(True) for n, t in zip(names, y)}
            out = torch.func.functional_call(model, yp, (to_input(ds.train_x[b], ds.mean, ds.std, torch.float64),))
            grads = torch.autograd.grad(torch.nn.functional.cross_entropy(out, ds.train_y[b]), list(yp.values()))
            for i in range(len(y)):
                g = grads[i] + wd * y[i] + gk * (y[i] - x[i])
                v_in[i] = mu * v_in[i] + g
                g = g + mu * v_in[i]
                y[i] = y[i] - lr * g
                z[i] = alpha * z[i] + (1 - alpha) * y[i]
        for i in range(len(x)):
            d = x[i] - z[i]
            v_out[i] = mu * v_out[i] + d
            d = d + mu * v_out[i]
            x[i] = x[i] - lr * d
    worst = max(float((got[n] - t).abs().max()) for n, t in zip(names, x))
    assert worst < 1e-10, worst
    # and training moved the weights (the comparison is not between two untouched inits)
    torch.manual_seed(42)
    init = build_model("lenet", num_classes=10, in_channels=1, dropout=0.0).to(torch.float64)
    assert max(float((got[n] - p.detach()).abs().max()) for n, p in init.named_parameters()) > 1e-3


@needs_fashion
def test_run_outputs_and_single_rank_counters(tmp_path):
    cfg = make_config(None, ["dist.backend=none", f"run.dir={tmp_path}", "run.progress=lines",
                             "data.train_limit=2048", "data.test_limit=500", "parle.sync_period=4",
                             "train.epochs=1", "eval.every=0.5", "run.ckpt_every=2",
                             "run.log_every=1"])
    s = train(cfg)
    for f in ("summary.json", "final.pt", "metrics.jsonl", "run.json", "config.json"):
        assert (tmp_path / f).is_file(), f
    summ = json.loads((tmp_path / "summary.json").read_text())
    for k in ("val_accuracy", "val_loss", "wall_seconds", "outer_steps", "samples_seen", "allreduce_calls",
              "bytes_communicated", "world_size", "algo", "config"):
        assert k in summ, k
    assert summ["outer_steps"] == math.ceil(16 / 4) and summ["samples_seen"] == 4 * 4 * 128
    assert summ["allreduce_calls"] == 0 and summ["bytes_communicated"] == 0   # one process: nothing sent
    assert summ["config"]["parle"]["sync_period"] == 4 and summ["algo"] == "parle"
    assert 0.3 < s["val_accuracy"] <= 1.0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["versions"]["torch"].startswith("2.") and "git_sha" in run and run["config"] == summ["config"]
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*lines)
    for k in ("train/loss", "train/loss_max", "val/loss", "val/accuracy", "parle/gamma", "parle/rho",
              "parle/lr", "parle/replica_distance", "parle/replica_distance_max", "comm/bytes",
              "comm/allreduce_calls", "perf/samples_per_sec"):
        assert k in keys, k
    assert sum("val/accuracy" in l for l in lines) == summ["evaluations"] == 2
    # TensorBoard event file holds the same tags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "val/accuracy", "parle/gamma", "parle/replica_distance", "comm/bytes",
            "perf/samples_per_sec"} <= tags
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2, 3, 4]
    # checkpoint files: step 2 and the final step, all state
    st = torch.load(tmp_path / "checkpoints/step-00000004/rank-0.pt", weights_only=False)
    for k in ("model", "ref", "algo_state", "sampler", "rng_torch", "sched", "step"):
        assert k in st
    assert set(st["algo_state"]["parle"]) >= {"x", "z", "v_in", "v_out"}
