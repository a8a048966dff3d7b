"""Every algorithm on 2 ranks, under both engines (horovodrun --gloo: Horovod; torchrun:
torch.distributed): runs to completion, writes the same outputs, and communicates exactly
what it should: how many collectives per outer step and what they carry (every 2-rank run
of an engine in this module as one job, one run after the other: each summary counts its own). Plus
data-parallel SGD and Parle in float64 against hand-written loops, under both engines,
and Parle's float64 run bit-identical between them."""
import json
import math
from pathlib import Path

import pytest
import torch

from multirank import DEFAULT, ENGINE_OF, ROOT, run_ranks, run_sweep
from parle_hvd.data import ReplicaSampler, load_dataset, replica_indices, to_input
from parle_hvd.models import build_model, sync_tensors
from parle_hvd.exchange import SLOT

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]
TRAIN = ROOT / "tests/ranks/train_rank.py"
HVD = pytest.mark.horovod     # skipped where Horovod is not installed (conftest.py)
ENGINES = [pytest.param("gloo", marks=HVD), "torchrun"]      # Horovod's engine, torch.distributed's
N_TRAIN, BS, L = 2560, 64, 5
COMMON = [f"data.train_limit={N_TRAIN}", "data.test_limit=1000", f"train.batch_size={BS}", "train.epochs=1",
          "eval.every=0.5", "eval.bn_batches=2", "run.progress=lines", f"parle.sync_period={L}",
          f"localsgd.sync_period={L}", f"diloco.sync_period={L}", f"train.block={L}", "elastic.sync_period=1"]


def _lenet_sizes():
    m = build_model("lenet", num_classes=10, in_channels=1, image_size=28)
    n_params = sum(p.numel() for p in m.parameters())
    n_sync = sum(t.numel() for t in sync_tensors(m))
    return m, n_params, n_sync


ALGOS = ["parle", "sgd", "dpsgd", "elastic", "entropy", "localsgd", "diloco"]


class _Runs(dict):
    """Run name -> run dir, of the runs that finished; asking for one that did not raises
    the sweep's error (with every rank's output)."""

    def __init__(self, finished: dict, error: Exception | None = None):
        super().__init__(finished)
        self.error = error

    def __missing__(self, name):
        raise self.error if self.error else KeyError(name)


@pytest.fixture(scope="module")
def every_algorithm(tmp_path_factory):
    """Every 2-rank run of this module under one engine, as one job that runs them one after
    the other (tests/ranks/sweep_rank.py: the world joined once, each run's own counts): the
    seven algorithms, the float64 dpsgd and Parle runs the hand-written loops check, and under
    the default launcher the split-data run. runs(controller) -> {algo or "dpsgd64", "parle64",
    "split": run dir}. One job instead of one per run (ten under the default launcher, nine
    under the other) saves a start of two ranks per run (~3.5 s each: torch, Dynamo and the
    launcher). A failed sweep is run once: each test whose run had finished goes on, the
    others report the sweep's error."""
    done = {}

    def runs(controller):
        if controller not in done:
            d = tmp_path_factory.mktemp(f"algos-{controller}")
            argv = {a: ["--config", "configs/fashion_parle.yaml", f"algo={a}", *COMMON, f"run.dir={d / a}"]
                    for a in ALGOS}
            argv["dpsgd64"] = _dpsgd64_args(d / "dpsgd64")
            argv["parle64"] = _parle64_args(d / "parle64")
            if controller == DEFAULT:
                argv["split"] = ["--config", "configs/fashion_parle.yaml", *COMMON, "data.split=frac",
                                 "data.frac=0.3", f"run.dir={d / 'split'}"]
            try:
                # (well under pytest's own 900 s per test, whose alarm would skip the except below)
                run_sweep(list(argv.values()), controller=controller, timeout=600)
                done[controller] = _Runs({name: d / name for name in argv})
            except Exception as e:
                done[controller] = _Runs({name: d / name for name in argv if (d / name / "summary.json").exists()}, e)
        return done[controller]
    return runs


@pytest.mark.parametrize("controller", ENGINES)
@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_on_two_ranks_communicates_as_designed(every_algorithm, algo, controller):
    run = every_algorithm(controller)[algo]
    s = json.loads((run / "summary.json").read_text())
    assert s["engine"] == ENGINE_OF[controller]
    for f in ("final.pt", "metrics.jsonl", "run.json", "config.json"):
        assert (run / f).is_file()
    assert s["algo"] == algo and s["world_size"] == 2 and 0.3 < s["val_accuracy"] <= 1.0
    model, P, S = _lenet_sizes()
    n_tensors = len(list(model.parameters()))
    K, E, Lk = s["outer_steps"], s["evaluations"], s["sync_period"]
    eval_bytes = 8 * (3 + 2 * 2)             # float64 [correct, loss, count] + two slots per replica (distance, skipped images)
    slots = 2 * len(SLOT)                     # one row per rank: loss, loss_max, distance, flags, step seconds
    plans = 2 * 2 * (3 + 2)                   # two steps' plans (gk, rk, lr, 2 replicas' inner steps), hi and lo
    sync_bytes = 4 * (S + plans + slots)      # float32: weights + BN stats, rank 0's plans, the slot rows
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
        # Every optimizer step allreduces every gradient (4 P bytes); plus one small float64
        # allreduce of the slot rows per outer step. Before an evaluation only the BatchNorm
        # statistics (S - P numbers) are averaged: the weights are the same on every rank and
        # are copied, not averaged (an average would round them).
        steps = K * Lk
        assert S > P
        assert s["allreduce_bytes"] == steps * 4 * P + K * 8 * slots + E * 4 * (S - P) + E * eval_bytes
        grad_calls = s["allreduce_calls"] - (K + E + E)
        if ENGINE_OF[controller] == "horovod":
            assert grad_calls == steps * n_tensors      # Horovod's way: one call per gradient tensor
        else:
            # DDP's way: one call per bucket; LeNet's 14 gradient tensors (0.5 MB) fit in one,
            # even DDP's first bucket (capped at 1 MB until it rebuilds them after step 1)
            assert 4 * P < 2**20 and grad_calls == steps
        assert s["broadcast_calls"] == 3
    else:   # sgd, entropy: independent replicas; the slot rows each outer step; rank 0's model per evaluation
        assert s["allreduce_calls"] == K + E and s["allreduce_bytes"] == K * 8 * slots + E * eval_bytes
        assert s["broadcast_calls"] == 2 + E
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["comm/allreduce_calls"] == s["allreduce_calls"]


D64 = dict(n_train=512, bs=32, steps=6, lr=0.05, wd=1e-3, mu=0.9)


def _dpsgd64_args(run):
    n_train, bs, steps, lr, wd, _ = D64.values()
    return ["--config", "configs/fashion_parle.yaml", "algo=dpsgd", "model.dtype=float64", "model.dropout=0.0",
            f"data.train_limit={n_train}", "data.test_limit=200", f"train.batch_size={bs}", f"train.block={steps}",
            f"train.epochs={steps / 8}", f"optim.lr={lr}", f"optim.weight_decay={wd}", "optim.schedule=constant",
            "eval.bn_batches=0", f"run.dir={run}", "run.progress=lines"]


@pytest.mark.parametrize("controller", ENGINES)
def test_dpsgd_float64_matches_hand_loop_with_averaged_gradients(every_algorithm, controller):
    """2 ranks, float64: the averaged gradients (Horovod's DistributedOptimizer, or
    DistributedDataParallel under torch) + Nesterov SGD equal a single-process loop over
    both ranks' batches to 1e-10."""
    run = every_algorithm(controller)["dpsgd64"]
    n_train, bs, steps, lr, wd, mu = D64.values()
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


def test_split_data_windows_same_step_count_on_every_rank(every_algorithm):
    """data.split=frac: each replica a window of 30% of the data; both ranks run the same
    number of outer steps (else the collectives would hang) and the run completes."""
    run = every_algorithm(DEFAULT)["split"]
    s = json.loads((run / "summary.json").read_text())
    nb = round(0.3 * N_TRAIN) // BS
    assert s["outer_steps"] == math.ceil(nb / L) and s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    assert s["config"]["data"]["frac"] == 0.3


P64 = dict(n_train=512, bs=32, L=4, K=6, lr=0.05, wd=1e-3, mu=0.9, alpha=0.75, g0=0.1, gmax=1.0, r0=1.0,
           rmax=10.0, s_=0.5, ms=0.6, decay=0.5)


def _parle64_args(d):
    p = P64
    return ["--config", "configs/fashion_parle.yaml", "algo=parle", "model.dtype=float64", "model.dropout=0.0",
            f"data.train_limit={p['n_train']}", "data.test_limit=200", f"train.batch_size={p['bs']}",
            f"parle.sync_period={p['L']}", f"train.epochs={p['K'] * p['L'] / (p['n_train'] // p['bs'])}",
            f"optim.lr={p['lr']}", f"optim.weight_decay={p['wd']}", f"optim.momentum={p['mu']}",
            "optim.schedule=step", f"optim.milestones=[{p['ms']}]", f"optim.decay={p['decay']}",
            f"parle.gamma0_inv={p['g0']}", f"parle.gamma_min_inv={p['gmax']}", f"parle.rho0_inv={p['r0']}",
            f"parle.rho_min_inv={p['rmax']}", f"parle.scoping={p['s_']}", f"parle.alpha={p['alpha']}",
            "parle.init=independent", "eval.bn_batches=0", "eval.every=100", "run.ckpt_every=2", "run.keep=100",
            f"run.dir={d}", "run.progress=lines"]


@pytest.fixture(scope="module")
def parle64(every_algorithm):
    """The float64 2-rank Parle run of the next two tests (in the engine's sweep): run(controller) -> run dir."""
    return lambda controller: every_algorithm(controller)["parle64"]


@pytest.mark.parametrize("controller", ENGINES)
def test_parle_float64_two_ranks_matches_hand_loop_with_step_schedule_and_momentum(parle64, controller):
    """2 ranks, float64, independent initialisations, 6 outer steps of L = 4 with a step
    learning-rate schedule, Nesterov momentum, weight decay, scoping and the elastic pull:
    both replicas and the reference equal a loop over both replicas written from PARLE.md,
    to 1e-10, under either engine."""
    run = parle64(controller)
    n_train, bs, L, K, lr, wd, mu, alpha = (P64[k] for k in ("n_train", "bs", "L", "K", "lr", "wd", "mu", "alpha"))
    g0, gmax, r0, rmax, s_, ms, decay = (P64[k] for k in ("g0", "gmax", "r0", "rmax", "s_", "ms", "decay"))
    nb = n_train // bs
    s = json.loads((run / "summary.json").read_text())
    assert s["outer_steps"] == K and s["engine"] == ENGINE_OF[controller]
    final = torch.load(run / "final.pt")
    got = [torch.load(run / f"checkpoints/step-{K:08d}/rank-{r}.pt", weights_only=False)["model"] for r in range(2)]

    ds = load_dataset("fashion-mnist", "", n_train, 200)
    models, x = [], []
    for a in range(2):
        torch.manual_seed(42 + a)           # replica a's own initialisation
        m = build_model("lenet", num_classes=10, in_channels=1, image_size=28, dropout=0.0).to(torch.float64)
        m.train()
        models.append(m)
        x.append({n: p.detach().clone() for n, p in m.named_parameters()})
    names = list(x[0])
    samplers = [ReplicaSampler(replica_indices(n_train, rank=a, world=2, split="full", frac=1.0, seed=42), bs,
                               seed=42, rank=a) for a in range(2)]
    v_in = [{n: torch.zeros_like(t) for n, t in x[a].items()} for a in range(2)]
    v_out = [{n: torch.zeros_like(t) for n, t in x[a].items()} for a in range(2)]
    for k in range(1, K + 1):
        gk, rk = min(g0 * (1 + s_ / nb) ** k, gmax), min(r0 * (1 + s_ / nb) ** k, rmax)
        passes = (k - 0.5) * L / nb                       # the lr is read at the middle of the step
        lr_k = lr * (decay if passes >= ms else 1.0)
        xbar = {n: (x[0][n] + x[1][n]) / 2 for n in names}
        new = []
        for a in range(2):
            y = {n: t.clone() for n, t in x[a].items()}
            z = {n: t.clone() for n, t in x[a].items()}
            for _ in range(L):
                b = samplers[a].next()
                yp = {n: t.clone().requires_grad_(True) for n, t in y.items()}
                out = torch.func.functional_call(models[a], yp, (to_input(ds.train_x[b], ds.mean, ds.std,
                                                                           torch.float64),))
                grads = torch.autograd.grad(torch.nn.functional.cross_entropy(out, ds.train_y[b]), list(yp.values()))
                for n, gr in zip(names, grads):
                    g = gr + wd * y[n] + gk * (y[n] - x[a][n])
                    v_in[a][n] = mu * v_in[a][n] + g
                    y[n] = y[n] - lr * (g + mu * v_in[a][n])
                    z[n] = alpha * z[n] + (1 - alpha) * y[n]
            xa = {}
            for n in names:
                d = (x[a][n] - z[n]) + rk * (x[a][n] - xbar[n])
                v_out[a][n] = mu * v_out[a][n] + d
                xa[n] = x[a][n] - lr_k * (d + mu * v_out[a][n])
            new.append(xa)
        x = new
    assert lr_k == lr * decay                             # the schedule really stepped
    worst = max(float((got[a][n] - x[a][n]).abs().max()) for a in range(2) for n in names)
    assert worst < 1e-10, worst
    ref_err = max(float((final[n] - (x[0][n] + x[1][n]) / 2).abs().max()) for n in names)
    assert ref_err < 1e-10, ref_err
    assert float((x[0][names[0]] - x[1][names[0]]).abs().max()) > 1e-3   # two distinct replicas


@HVD
def test_parle_float64_two_ranks_bit_identical_between_engines(parle64):
    """The same float64 2-rank Parle run through Horovod (horovodrun --gloo) and through
    torch.distributed (torchrun): every checkpoint (both replicas, their optimizer state,
    the reference) and the final model are equal bit for bit, and so are the counters."""
    a, b = parle64("gloo"), parle64("torchrun")
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    # (broadcast bytes differ by the length of run.dir inside the broadcast config)
    for key in ("allreduce_calls", "allreduce_bytes", "broadcast_calls", "val_loss", "val_accuracy"):
        assert sa[key] == sb[key], key
    fa, fb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    steps = sorted(p.name for p in (a / "checkpoints").iterdir())
    assert len(steps) == 3 and steps == sorted(p.name for p in (b / "checkpoints").iterdir())

    def flat(obj, pre=""):
        if isinstance(obj, torch.Tensor):
            yield pre, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from flat(v, f"{pre}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from flat(v, f"{pre}/{i}")
    for step in steps:
        for r in range(2):
            ca = dict(flat(torch.load(a / "checkpoints" / step / f"rank-{r}.pt", weights_only=False)))
            cb = dict(flat(torch.load(b / "checkpoints" / step / f"rank-{r}.pt", weights_only=False)))
            assert ca.keys() == cb.keys() and len(ca) > 50
            for k in ca:
                assert torch.equal(ca[k], cb[k]), (step, r, k)


def test_dpsgd_three_ranks_ships_exactly_the_trained_weights(tmp_path):
    """3 ranks (shards of 2560 / 3, not a whole number): the evaluated and shipped model's
    weights are bit-identical to every rank's trained ones ((w+w+w)/3 != w in float32)."""
    run = tmp_path / "run"
    run_ranks(TRAIN, np=3, args=["--config", "configs/fashion_parle.yaml", "algo=dpsgd", *COMMON, f"run.dir={run}",
                                 "train.epochs=0.5"], timeout=240, reports=False)
    s = json.loads((run / "summary.json").read_text())
    final = torch.load(run / "final.pt")
    K = s["outer_steps"]
    nb = (N_TRAIN // 3) // BS                           # the smallest shard's full batches, on every rank
    assert K == math.ceil(0.5 * nb / L)
    for r in range(3):
        m = torch.load(run / f"checkpoints/step-{K:08d}/rank-{r}.pt", weights_only=False)["model"]
        for n, p in m.items():
            if "running" not in n and "num_batches" not in n:
                assert torch.equal(final[n], p), (r, n)
