"""Every algorithm on 2 ranks (horovodrun --gloo): runs to completion, writes the same
outputs, and communicates exactly what it should: how many collectives per outer step
and what they carry. Plus data-parallel SGD in float64 against a hand-written loop."""
import json
import math
from pathlib import Path

import pytest
import torch

from multirank import ROOT, run_ranks
from parle_hvd.data import ReplicaSampler, load_dataset, replica_indices, to_input
from parle_hvd.models import build_model, sync_tensors
from parle_hvd.trainer import SLOT

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]
TRAIN = ROOT / "tests/ranks/train_rank.py"
N_TRAIN, BS, L = 2560, 64, 5
COMMON = [f"data.train_limit={N_TRAIN}", "data.test_limit=1000", f"train.batch_size={BS}", "train.epochs=1",
          "eval.every=0.5", "eval.bn_batches=2", "run.progress=lines", f"parle.sync_period={L}",
          f"localsgd.sync_period={L}", f"diloco.sync_period={L}", f"train.block={L}", "elastic.sync_period=1"]


def _lenet_sizes():
    m = build_model("lenet", num_classes=10, in_channels=1, image_size=28)
    n_params = sum(p.numel() for p in m.parameters())
    n_sync = sum(t.numel() for t in sync_tensors(m))
    return m, n_params, n_sync


@pytest.mark.parametrize("algo", ["parle", "sgd", "dpsgd", "elastic", "entropy", "localsgd", "diloco"])
def test_every_algorithm_on_two_ranks_communicates_as_designed(tmp_path, algo):
    run = tmp_path / "run"
    run_ranks(TRAIN, args=["--config", "configs/fashion_parle.yaml", f"algo={algo}", *COMMON, f"run.dir={run}"],
              timeout=240, reports=False)
    s = json.loads((run / "summary.json").read_text())
    for f in ("final.pt", "metrics.jsonl", "run.json", "config.json"):
        assert (run / f).is_file()
    assert s["algo"] == algo and s["world_size"] == 2 and 0.3 < s["val_accuracy"] <= 1.0
    model, P, S = _lenet_sizes()
    n_tensors = len(list(model.parameters()))
    K, E, Lk = s["outer_steps"], s["evaluations"], s["sync_period"]
    eval_bytes = 8 * (3 + 2 * 1)             # float64 [correct, loss, count] + one slot per replica
    slots = 2 * len(SLOT)                     # one row per rank: loss, loss_max, distance, nonfinite, stop, hosts
    sync_bytes = 4 * (S + 2 * 3 + slots)      # float32: weights + BN stats, schedule (hi, lo), the slot rows
    nb = N_TRAIN // BS // (2 if algo == "dpsgd" else 1)
    assert K == math.ceil(nb / Lk) and E == 2
    if algo in ("parle", "localsgd", "diloco", "elastic"):
        # one fused allreduce per outer step (+1 for the first reference), one per evaluation
        assert Lk == (1 if algo == "elastic" else L)
        assert s["allreduce_calls"] == K + 1 + E
        assert s["allreduce_bytes"] == (K + 1) * sync_bytes + E * eval_bytes
        # config from rank 0 (length + payload), and rank 0's initial weights where required
        assert s["broadcast_calls"] == 2 + (algo in ("localsgd", "diloco"))
    elif algo == "dpsgd":
        # Horovod's way: every optimizer step allreduces every gradient tensor; plus one small
        # float64 allreduce of the slot rows per outer step, and BN statistics per evaluation
        steps = K * Lk
        assert s["allreduce_calls"] == steps * n_tensors + K + E + E >= steps
        assert s["allreduce_bytes"] == steps * 4 * P + K * 8 * slots + E * 4 * S + E * eval_bytes
        assert s["broadcast_calls"] == 3
    else:   # sgd, entropy: independent replicas; the slot rows each outer step; rank 0's model per evaluation
        assert s["allreduce_calls"] == K + E and s["allreduce_bytes"] == K * 8 * slots + E * eval_bytes
        assert s["broadcast_calls"] == 2 + E
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["comm/allreduce_calls"] == s["allreduce_calls"]


def test_dpsgd_float64_matches_hand_loop_with_averaged_gradients(tmp_path):
    """2 ranks, float64: Horovod's averaged gradients + Nesterov SGD equal a single-process
    loop over both ranks' batches to 1e-10."""
    run = tmp_path / "run"
    n_train, bs, steps, lr, wd, mu = 512, 32, 6, 0.05, 1e-3, 0.9
    run_ranks(TRAIN, args=["--config", "configs/fashion_parle.yaml", "algo=dpsgd", "model.dtype=float64",
                           "model.dropout=0.0", f"data.train_limit={n_train}", "data.test_limit=200",
                           f"train.batch_size={bs}", f"train.block={steps}", f"train.epochs={steps / 8}",
                           f"optim.lr={lr}", f"optim.weight_decay={wd}", "optim.schedule=constant",
                           "eval.bn_batches=0", f"run.dir={run}", "run.progress=lines"], timeout=240, reports=False)
    s = json.loads((run / "summary.json").read_text())
    assert s["inner_steps"] == steps
    got = torch.load(run / "final.pt")

    ds = load_dataset("fashion-mnist", "", n_train, 200)
    torch.manual_seed(42)     # rank 0's initialisation, broadcast to rank 1
    model = build_model("lenet", num_classes=10, in_channels=1, image_size=28, dropout=0.0).to(torch.float64)
    names = [n for n, _ in model.named_parameters()]
    x = {n: p.detach().clone() for n, p in model.named_parameters()}
    v = {n: torch.zeros_like(t) for n, t in x.items()}
    samplers = [ReplicaSampler(replica_indices(n_train, rank=r, world=2, split="frac", frac=0.5, seed=42),
                               bs, seed=42, rank=r) for r in range(2)]
    model.train()
    for _ in range(steps):
        gsum = {n: torch.zeros_like(t) for n, t in x.items()}
        for r in range(2):
            b = samplers[r].next()
            xp = {n: t.clone().requires_grad_(True) for n, t in x.items()}
            out = torch.func.functional_call(model, xp, (to_input(ds.train_x[b], ds.mean, ds.std, torch.float64),))
            gs = torch.autograd.grad(torch.nn.functional.cross_entropy(out, ds.train_y[b]), list(xp.values()))
            for n, g in zip(names, gs):
                gsum[n] += g
        for n in names:
            g = gsum[n] / 2 + wd * x[n]
            v[n] = mu * v[n] + g
            x[n] = x[n] - lr * (g + mu * v[n])
    worst = max(float((got[n] - x[n]).abs().max()) for n in names)
    assert worst < 1e-10, worst


def test_split_data_windows_same_step_count_on_every_rank(tmp_path):
    """data.split=frac: each replica a window of 30% of the data; both ranks run the same
    number of outer steps (else the collectives would hang) and the run completes."""
    run = tmp_path / "run"
    run_ranks(TRAIN, args=["--config", "configs/fashion_parle.yaml", *COMMON, "data.split=frac",
                     "data.frac=0.3", f"run.dir={run}"], timeout=240, reports=False)
    s = json.loads((run / "summary.json").read_text())
    nb = round(0.3 * N_TRAIN) // BS
    assert s["outer_steps"] == math.ceil(nb / L) and s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    assert s["config"]["data"]["frac"] == 0.3
