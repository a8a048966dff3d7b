"""Every algorithm in float64 against a hand-written reference loop.

The algorithms are driven exactly as the trainer drives them (begin_outer, inner_step,
end_outer, sync, after_sync), with the allreduce simulated in one process by a mean over
the replicas. The hand-written loops use plain tensor arithmetic only."""
import copy
import math

import pytest
import torch
from torch import nn

from parle_hvd.algorithms import make_algorithm
from parle_hvd.config import make_config
from parle_hvd.data import _gen
from parle_hvd.diloco import diloco_outer_step_
from parle_hvd.easgd import elastic_step_
from parle_hvd.models import sync_tensors

D_IN, D_OUT = 4, 3


class Tiny(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.fc = nn.Linear(D_IN, D_OUT).double()
        with torch.no_grad():
            self.fc.weight.copy_(w)
            self.fc.bias.copy_(b)

    def forward(self, x):
        return self.fc(x)


def batches(n, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(8, D_IN, generator=g, dtype=torch.float64), torch.randint(0, D_OUT, (8,), generator=g))
             for _ in range(steps)] for _ in range(n)]


def inits(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64),
             torch.randn(D_OUT, generator=g, dtype=torch.float64)) for _ in range(n)]


def grad(w, b, batch):
    w = w.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    nn.functional.cross_entropy(batch[0] @ w.T + b, batch[1]).backward()
    return [w.grad, b.grad]


def simulate(name, over, n, K, data, x0, *, sched):
    """Run algorithm ``name`` on n simulated replicas for K outer steps, as the trainer does."""
    cfg = make_config(None, [f"algo={name}", *over])
    models = [Tiny(*x0[a]) for a in range(n)]
    algos = [make_algorithm(name, models[a], cfg, n, a) for a in range(n)]
    refs = [copy.deepcopy(m) for m in models]
    L = algos[0].L

    def sync():
        mean = [sum(ts) / n for ts in zip(*[sync_tensors(m) for m in models])]
        for a in range(n):
            with torch.no_grad():
                for r, v in zip(sync_tensors(refs[a]), mean):
                    r.copy_(v)
            algos[a].after_sync(sync_tensors(models[a]), sync_tensors(refs[a]))

    if algos[0].syncs:
        sync()
    step = 0
    for k in range(1, K + 1):
        gk, rk, lr = sched(k)
        for a in range(n):
            algos[a].begin_outer()
        for l in range(L):
            for a in range(n):
                models[a].zero_grad(set_to_none=True)
                nn.functional.cross_entropy(models[a](data[a][step][0]), data[a][step][1]).backward()
                algos[a].inner_step(gk=gk, rk=rk, lr=lr, xbar=list(refs[a].parameters()))
            step += 1
        for a in range(n):
            algos[a].end_outer(list(refs[a].parameters()), rk=rk, lr=lr)
        if algos[0].syncs:
            sync()
    return models, refs, algos


def flat(m):
    return [p.detach().clone() for p in m.parameters()]


def close(a, b, tol=1e-12):
    return all(float((x - y).abs().max()) < tol for x, y in zip(a, b))


WD, MU, LR = 1e-3, 0.9, 0.05


def nesterov(x, g, v, lr, wd=WD, mu=MU):
    g = g + wd * x
    v = mu * v + g
    return x - lr * (g + mu * v), v


def test_sgd_matches_hand_loop():
    K, L = 3, 4
    data, x0 = batches(1, K * L), inits(1)
    models, _, _ = simulate("sgd", [f"train.block={L}", f"optim.weight_decay={WD}"], 1, K, data, x0,
                            sched=lambda k: (0, 0, LR * 0.5 ** (k - 1)))
    x, v = list(x0[0]), [torch.zeros_like(t) for t in x0[0]]
    for t in range(K * L):
        lr = LR * 0.5 ** (t // L)
        g = grad(*x, data[0][t])
        for i in range(2):
            x[i], v[i] = nesterov(x[i], g[i], v[i], lr)
    assert close(flat(models[0]), x)


def test_localsgd_matches_hand_loop():
    n, K, L = 3, 3, 4
    data, x0 = batches(n, K * L), inits(1) * n          # same start (same_init)
    models, refs, _ = simulate("localsgd", [f"localsgd.sync_period={L}", f"optim.weight_decay={WD}"], n, K, data,
                               x0, sched=lambda k: (0, 0, LR))
    x = [list(x0[a]) for a in range(n)]
    v = [[torch.zeros_like(t) for t in x0[0]] for _ in range(n)]
    for k in range(K):
        for l in range(L):
            for a in range(n):
                g = grad(*x[a], data[a][k * L + l])
                for i in range(2):
                    x[a][i], v[a][i] = nesterov(x[a][i], g[i], v[a][i], LR)
        mean = [sum(x[a][i] for a in range(n)) / n for i in range(2)]
        x = [[m.clone() for m in mean] for _ in range(n)]   # momentum buffers stay local
    for a in range(n):
        assert close(flat(models[a]), x[a])
    assert close(flat(refs[0]), x[0])


@pytest.mark.parametrize("tau,mu", [(1, 0.0), (1, MU), (3, MU)])
def test_elastic_matches_parle_md_formula(tau, mu):
    n, K = 3, 4
    s, nb, r0, rmax = 0.5, 2, 1.0, 2.0
    data, x0 = batches(n, K * tau), inits(n)
    rk_of = lambda k: min(r0 * (1 + s / nb) ** k, rmax)
    # optim.momentum stays at its default 0.9: Elastic-SGD's own momentum is elastic.momentum
    # (0 by default, PARLE.md's form)
    over = [f"elastic.sync_period={tau}", f"optim.weight_decay={WD}"] + ([f"elastic.momentum={mu}"] if mu else [])
    models, _, _ = simulate("elastic", over, n, K, data, x0,
                            sched=lambda k: (0, rk_of(k), LR))
    x = [list(x0[a]) for a in range(n)]
    v = [[torch.zeros_like(t) for t in x0[0]] for _ in range(n)]
    xbar = [sum(x[a][i] for a in range(n)) / n for i in range(2)]
    for k in range(1, K + 1):
        rk = rk_of(k)
        for l in range(tau):
            for a in range(n):
                g = grad(*x[a], data[a][(k - 1) * tau + l])
                for i in range(2):
                    d = g[i] + WD * x[a][i] + rk * (x[a][i] - xbar[i])
                    v[a][i] = mu * v[a][i] + d
                    x[a][i] = x[a][i] - LR * (d + mu * v[a][i])
        xbar = [sum(x[a][i] for a in range(n)) / n for i in range(2)]
    for a in range(n):
        assert close(flat(models[a]), x[a])


def test_elastic_step_function_plain_formula():
    x, g, xb, v = [torch.ones(2, dtype=torch.float64)], [torch.full((2,), 0.5, dtype=torch.float64)], \
        [torch.zeros(2, dtype=torch.float64)], [torch.zeros(2, dtype=torch.float64)]
    elastic_step_(x, g, xb, v, lr=0.1, rho_inv=2.0, weight_decay=0.1, momentum=0.0, nesterov=True)
    assert torch.allclose(x[0], torch.full((2,), 1 - 0.1 * (0.5 + 0.1 + 2.0), dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("noise", [0.0, 1e-2])
def test_entropy_matches_hand_loop_with_langevin_noise(noise):
    K, L, alpha, g0, gmax, s, nb = 3, 5, 0.75, 0.3, 1.0, 0.5, 2
    data, x0 = batches(1, K * L), inits(1)
    gk_of = lambda k: min(g0 * (1 + s / nb) ** k, gmax)
    seed = 42
    models, _, _ = simulate("entropy", [f"parle.sync_period={L}", f"optim.weight_decay={WD}", f"entropy.noise={noise}", f"optim.lr={LR}",
                                         f"train.seed={seed}"], 1, K, data, x0,
                            sched=lambda k: (gk_of(k), 99.0, LR))   # rk is ignored: one replica
    gen = _gen("langevin", seed, 0)           # the replica's own stream (data._gen)
    x = list(x0[0])
    v_in = [torch.zeros_like(t) for t in x]
    v_out = [torch.zeros_like(t) for t in x]
    for k in range(1, K + 1):
        gk = gk_of(k)
        y, z = [t.clone() for t in x], [t.clone() for t in x]
        for l in range(L):
            g = grad(*y, data[0][(k - 1) * L + l])
            for i in range(2):
                gi = g[i] + WD * y[i] + gk * (y[i] - x[i])
                v_in[i] = MU * v_in[i] + gi
                y[i] = y[i] - LR * (gi + MU * v_in[i])
                if noise:
                    y[i] = y[i] + math.sqrt(LR) * noise * torch.randn(y[i].shape, generator=gen, dtype=torch.float64)
                z[i] = alpha * z[i] + (1 - alpha) * y[i]
        for i in range(2):
            d = x[i] - z[i]
            v_out[i] = MU * v_out[i] + d
            x[i] = x[i] - LR * (d + MU * v_out[i])
    assert close(flat(models[0]), x)


def adamw(x, g, m, v, t, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    x = x * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return x - lr * mhat / (vhat.sqrt() + eps), m, v


@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_diloco_matches_hand_loop(inner):
    n, K, H, olr, omu = 3, 3, 4, 0.7, 0.9
    ilr = LR if inner == "sgd" else 1e-2
    data, x0 = batches(n, K * H), inits(1) * n
    models, refs, _ = simulate("diloco", [f"diloco.sync_period={H}", f"diloco.inner={inner}", f"diloco.inner_lr={ilr}",
                                          f"optim.weight_decay={WD}", f"optim.lr={LR}"], n, K, data, x0,
                               sched=lambda k: (0, 0, LR))
    theta = list(x0[0])
    x = [list(x0[0]) for _ in range(n)]
    st = [[[torch.zeros_like(t) for t in theta] for _ in range(2)] for _ in range(n)]   # inner state per replica
    vo = [torch.zeros_like(t) for t in theta]

    for k in range(K):
        for l in range(H):
            for a in range(n):
                g = grad(*x[a], data[a][k * H + l])
                for i in range(2):
                    if inner == "sgd":
                        x[a][i], st[a][0][i] = nesterov(x[a][i], g[i], st[a][0][i], ilr)
                    else:
                        x[a][i], st[a][0][i], st[a][1][i] = adamw(x[a][i], g[i], st[a][0][i], st[a][1][i],
                                                                  k * H + l + 1, ilr, WD)
        for i in range(2):
            delta = theta[i] - sum(x[a][i] for a in range(n)) / n     # averaged pseudo-gradient
            vo[i] = omu * vo[i] + delta
            theta[i] = theta[i] - olr * (delta + omu * vo[i])
        x = [[th.clone() for th in theta] for _ in range(n)]
    for a in range(n):
        assert close(flat(models[a]), theta, 1e-10)
    assert close(flat(refs[0]), theta, 1e-10)      # the reference is the global model


def test_diloco_outer_step_zero_delta_is_noop():
    th = [torch.arange(3.0, dtype=torch.float64)]
    v = [torch.zeros(3, dtype=torch.float64)]
    diloco_outer_step_(th, [th[0].clone()], v, lr=0.7, momentum=0.9)
    assert th[0].tolist() == [0.0, 1.0, 2.0] and v[0].abs().sum() == 0


def test_parle_adapter_matches_parle_math_special_case():
    """The trainer's parle adapter on 3 simulated replicas equals the hand loop of PARLE.md
    (the full loop is in test_parle.py; this pins the adapter's wiring: inner lr fixed,
    outer lr from the schedule, elastic pull toward the reference)."""
    n, K, L = 3, 3, 3
    data, x0 = batches(n, K * L), inits(n)
    sched = lambda k: (0.2 * k, 0.5 * k, LR / k)
    models, _, _ = simulate("parle", [f"parle.sync_period={L}", f"optim.lr={LR}", f"optim.weight_decay={WD}"], n, K,
                            data, x0, sched=sched)
    x = [list(x0[a]) for a in range(n)]
    vi = [[torch.zeros_like(t) for t in x0[0]] for _ in range(n)]
    vo = [[torch.zeros_like(t) for t in x0[0]] for _ in range(n)]
    for k in range(1, K + 1):
        gk, rk, lrk = sched(k)
        xbar = [sum(x[a][i] for a in range(n)) / n for i in range(2)]
        new = []
        for a in range(n):
            y, z = [t.clone() for t in x[a]], [t.clone() for t in x[a]]
            for l in range(L):
                g = grad(*y, data[a][(k - 1) * L + l])
                for i in range(2):
                    gi = g[i] + WD * y[i] + gk * (y[i] - x[a][i])
                    vi[a][i] = MU * vi[a][i] + gi
                    y[i] = y[i] - LR * (gi + MU * vi[a][i])
                    z[i] = 0.75 * z[i] + 0.25 * y[i]
            xa = []
            for i in range(2):
                d = (x[a][i] - z[i]) + rk * (x[a][i] - xbar[i])
                vo[a][i] = MU * vo[a][i] + d
                xa.append(x[a][i] - lrk * (d + MU * vo[a][i]))
            new.append(xa)
        x = new
    for a in range(n):
        assert close(flat(models[a]), x[a])
