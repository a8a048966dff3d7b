"""The Parle math in float64 against a hand-written loop that follows PARLE.md line by
line, each special case of PARLE.md, and the schedules against their closed forms."""
import copy
import math

import pytest
import torch

from parle_hvd.parle import (Parle, coupling, coupling_auto, lr_at, parle_inner_step_, parle_outer_step_, scoping,
                             scoping_auto, z_average_)

D_IN, D_OUT = 4, 3


@pytest.fixture(autouse=True)
def float64_default():
    """Every tensor in these tests is float64; restored afterwards so that no other test
    (e.g. one that initialises a model in float32 to compare with another process) is affected."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def loss_fn(W, b, batch):
    X, t = batch
    return torch.nn.functional.cross_entropy(X @ W.T + b, t)


def grad_flat(v, batch):
    """grad f at the flat vector v = [W.flatten(), b]."""
    v = v.detach().clone().requires_grad_(True)
    W, b = v[:D_IN * D_OUT].view(D_OUT, D_IN), v[D_IN * D_OUT:]
    loss_fn(W, b, batch).backward()
    return v.grad.detach()


def make_batches(n, K, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[[(torch.randn(8, D_IN, generator=g), torch.randint(0, D_OUT, (8,), generator=g))
              for _ in range(L)] for _ in range(K)] for _ in range(n)]


def reference_loop(x0, batches, *, K, L, nb, lr, lr_sched, g0, gmax, r0, rmax, s, wd, mu, alpha, nesterov=True):
    """PARLE.md's "One outer step k", written out on flat vectors, replicas in parallel
    (``nesterov=False``: heavy-ball momentum, the step direction is the buffer itself)."""
    n = len(x0)
    x = [v.clone() for v in x0]
    v_in = [torch.zeros_like(v) for v in x0]
    v_out = [torch.zeros_like(v) for v in x0]
    for k in range(1, K + 1):
        gk = min(g0 * (1 + s / nb) ** k, gmax)
        rk = min(r0 * (1 + s / nb) ** k, rmax)
        lr_k = lr_sched(k)
        xbar = sum(x) / n
        new = []
        for a in range(n):
            y = x[a].clone()
            z = x[a].clone()
            for l in range(L):
                g = grad_flat(y, batches[a][k - 1][l]) + wd * y + gk * (y - x[a])
                v_in[a] = mu * v_in[a] + g
                g = g + mu * v_in[a] if nesterov else v_in[a]
                y = y - lr * g
                z = alpha * z + (1 - alpha) * y
            d = (x[a] - z) + rk * (x[a] - xbar)
            v_out[a] = mu * v_out[a] + d
            d = d + mu * v_out[a] if nesterov else v_out[a]
            new.append(x[a] - lr_k * d)
        x = new
    return x


def run_parle(x0, batches, *, K, L, nb, lr, lr_sched, g0, gmax, r0, rmax, s, wd, mu, alpha, nesterov=True,
              resume=None):
    """The library: one Parle object per replica, the allreduce simulated by a mean.
    ``resume=(k0, [(weights, state_dict) per replica])`` continues after outer step k0 from
    saved weights (x[a]) and optimizer states, loaded in the trainer's order: weights first."""
    n = len(x0)
    params = [[torch.nn.Parameter(v[:D_IN * D_OUT].view(D_OUT, D_IN).clone()),
               torch.nn.Parameter(v[D_IN * D_OUT:].clone())] for v in x0]
    opts = [Parle(p, inner_lr=lr, sync_period=L, alpha=alpha, momentum=mu, nesterov=nesterov,
                  weight_decay=wd) for p in params]
    k0 = 0
    if resume:
        k0, states = resume
        for a in range(n):
            weights, st = states[a]
            with torch.no_grad():
                for p, x in zip(params[a], weights):
                    p.copy_(x)
            opts[a].load_state_dict(st)
    for k in range(k0 + 1, K + 1):
        gk, rk = scoping(k, gamma0_inv=g0, gamma_min_inv=gmax, rho0_inv=r0, rho_min_inv=rmax, scoping=s, nb=nb)
        xbar = [sum(params[a][i].detach() for a in range(n)) / n for i in range(2)]
        for a in range(n):
            opts[a].begin_outer()
            for l in range(L):
                for p in params[a]:
                    p.grad = None
                loss_fn(*params[a], batches[a][k - 1][l]).backward()
                opts[a].inner_step(gamma_inv=gk)
        for a in range(n):
            opts[a].outer_step(xbar, rho_inv=rk, lr=lr_sched(k))
    return [torch.cat([p[0].detach().flatten(), p[1].detach()]) for p in params], opts


def x0s(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(D_IN * D_OUT + D_OUT, generator=g) for _ in range(n)]


HP = dict(K=6, L=4, nb=2, lr=0.1, g0=0.5, gmax=1.0, r0=1.0, rmax=2.0, s=0.5, wd=1e-3, mu=0.9, alpha=0.75)


def test_several_outer_steps_match_reference_loop_with_scoping_and_caps():
    n = 3
    lr_sched = lambda k: lr_at((k - 1) * HP["L"] / HP["nb"], lr=0.1, schedule="step", milestones=[6.0], decay=0.5)
    b = make_batches(n, HP["K"], HP["L"])
    # scoping really moves and both caps are reached within K steps
    assert coupling(1, start=0.5, cap=1.0, scoping=0.5, nb=2) < 1.0
    assert coupling(HP["K"], start=0.5, cap=1.0, scoping=0.5, nb=2) == 1.0
    assert coupling(HP["K"], start=1.0, cap=2.0, scoping=0.5, nb=2) == 2.0
    ref = reference_loop(x0s(n), b, lr_sched=lr_sched, **HP)
    got, _ = run_parle(x0s(n), b, lr_sched=lr_sched, **HP)
    for a in range(n):
        assert torch.allclose(got[a], ref[a], rtol=0, atol=1e-12), (a, (got[a] - ref[a]).abs().max())
    # and the replicas did move from where they started, and toward each other: the spread
    # around their mean shrinks, and shrinks more than without the elastic coupling
    assert all((g - x).abs().max() > 1e-2 for g, x in zip(got, x0s(n)))
    spread = lambda xs: float(sum((x - sum(xs) / len(xs)).norm() for x in xs))
    free, _ = run_parle(x0s(n), b, lr_sched=lr_sched, **{**HP, "r0": 0.0, "rmax": 0.0})
    assert spread(got) < 0.8 * spread(x0s(n)), (spread(got), spread(x0s(n)))
    assert spread(got) < 0.8 * spread(free), (spread(got), spread(free))


def test_n1_is_entropy_sgd_without_elastic_term():
    """n = 1: xbar = x, so any rk gives the same result, equal to Entropy-SGD (no Langevin)."""
    b = make_batches(1, 3, 5)
    lr_sched = lambda k: 0.1
    a, _ = run_parle(x0s(1), b, lr_sched=lr_sched, **{**HP, "K": 3, "L": 5, "r0": 5.0, "rmax": 50.0})
    c, _ = run_parle(x0s(1), b, lr_sched=lr_sched, **{**HP, "K": 3, "L": 5, "r0": 0.0, "rmax": 0.0})
    ref = reference_loop(x0s(1), b, lr_sched=lr_sched, **{**HP, "K": 3, "L": 5, "r0": 0.0, "rmax": 0.0})
    assert torch.equal(a[0], c[0])
    assert torch.allclose(a[0], ref[0], rtol=0, atol=1e-12)


def test_L1_no_coupling_no_momentum_is_one_sgd_step():
    """L = 1, gk = 0, alpha = 0, no momentum, lr_k = 1: x - lr_inner * (grad + wd x)."""
    b = make_batches(1, 1, 1)
    x0 = x0s(1)
    got, _ = run_parle(x0, b, lr_sched=lambda k: 1.0, K=1, L=1, nb=1, lr=0.05, g0=0.0, gmax=0.0,
                       r0=0.0, rmax=0.0, s=0.5, wd=1e-3, mu=0.0, alpha=0.0)
    want = x0[0] - 0.05 * (grad_flat(x0[0], b[0][0][0]) + 1e-3 * x0[0])
    assert torch.allclose(got[0], want, rtol=0, atol=1e-15)


def test_elastic_sgd_special_case():
    """Elastic-SGD, x -= lr*(grad + wd x + rk (x - xbar)) with xbar every step, is Parle
    with L = 1, gk = 0, alpha = 0, no momentum, lr_k = 1 and outer coupling lr*rk."""
    n, lr, rk, K = 3, 0.05, 2.0, 4
    b = make_batches(n, K, 1)
    got, _ = run_parle(x0s(n), b, lr_sched=lambda k: 1.0, K=K, L=1, nb=10**9, lr=lr, g0=0.0, gmax=0.0,
                       r0=lr * rk, rmax=lr * rk, s=0.0, wd=1e-3, mu=0.0, alpha=0.0)
    x = x0s(n)
    for k in range(K):
        xbar = sum(x) / n
        x = [x[a] - lr * (grad_flat(x[a], b[a][k][0]) + 1e-3 * x[a] + rk * (x[a] - xbar)) for a in range(n)]
    for a in range(n):
        assert torch.allclose(got[a], x[a], rtol=0, atol=1e-14)


def test_reference_follows_data_parallel_sgd():
    """Data-parallel SGD: with identical replicas, L = 1, gk = 0, alpha = 0, no momentum,
    lr_k = 1 and rk = 1, every replica becomes xbar - lr*g_a, so the reference takes
    exactly the data-parallel step xbar - lr * mean_a(g_a)."""
    n, lr, K = 3, 0.1, 4
    b = make_batches(n, K + 1, 1)
    start = x0s(1)[0]
    got, _ = run_parle([start.clone() for _ in range(n)], b, lr_sched=lambda k: 1.0, K=K, L=1, nb=10**9,
                       lr=lr, g0=0.0, gmax=0.0, r0=1.0, rmax=1.0, s=0.0, wd=0.0, mu=0.0, alpha=0.0)
    # Each replica computes its gradient at the point it holds, xbar - lr*g_a of the previous
    # step; the reference moves by exactly the averaged-gradient step at every step.
    x = [start.clone() for _ in range(n)]
    for k in range(K):
        xbar = sum(x) / n
        g = [grad_flat(x[a], b[a][k][0]) for a in range(n)]
        x = [xbar - lr * g[a] for a in range(n)]
        assert torch.allclose(sum(x) / n, xbar - lr * sum(g) / n, rtol=0, atol=1e-15)
    for a in range(n):
        assert torch.allclose(got[a], x[a], rtol=0, atol=1e-14)


def test_functions_in_place_and_keyword_only():
    y, x, v = [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)]
    with pytest.raises(TypeError):
        parle_inner_step_(y, [torch.ones(3)], x, v, 0.1)  # hyper-parameters are keyword-only
    parle_inner_step_(y, [torch.ones(3)], x, v, lr=0.1, gamma_inv=1.0, weight_decay=0.0, momentum=0.0,
                      nesterov=True)
    assert torch.allclose(y[0], torch.full((3,), 1 - 0.1 * (1 + 1)))
    z = [torch.zeros(3)]
    z_average_(z, [torch.ones(3)], alpha=0.75)
    assert torch.allclose(z[0], torch.full((3,), 0.25))
    xs, vo = [torch.ones(3)], [torch.zeros(3)]
    parle_outer_step_(xs, [torch.zeros(3)], [torch.zeros(3)], vo, lr=0.5, rho_inv=2.0, momentum=0.9, nesterov=True)
    # d = 1 + 2*1 = 3; v = 3; d = 3 + 0.9*3 = 5.7; x = 1 - 0.5*5.7
    assert torch.allclose(xs[0], torch.full((3,), 1 - 0.5 * 5.7)) and torch.allclose(vo[0], torch.full((3,), 3.0))


def test_grad_none_gets_only_decay_and_coupling():
    y, x, v = [torch.ones(2)], [torch.zeros(2)], [torch.zeros(2)]
    parle_inner_step_(y, [None], x, v, lr=0.1, gamma_inv=0.5, weight_decay=0.1, momentum=0.0, nesterov=True)
    assert torch.allclose(y[0], torch.full((2,), 1 - 0.1 * (0.1 + 0.5)))


def test_heavy_ball_over_several_outer_steps_matches_reference_loop():
    """nesterov=False through K = 6 outer steps (both buffers carried across steps), with
    scoping, the elastic term and weight decay: equal to the heavy-ball reference loop."""
    n = 2
    b = make_batches(n, HP["K"], HP["L"], seed=3)
    lr_sched = lambda k: 0.1 if k < 4 else 0.05
    ref = reference_loop(x0s(n), b, lr_sched=lr_sched, nesterov=False, **HP)
    got, _ = run_parle(x0s(n), b, lr_sched=lr_sched, nesterov=False, **HP)
    nest = reference_loop(x0s(n), b, lr_sched=lr_sched, **HP)
    for a in range(n):
        assert torch.allclose(got[a], ref[a], rtol=0, atol=1e-12), (a, (got[a] - ref[a]).abs().max())
        assert not torch.allclose(got[a], nest[a], rtol=0, atol=1e-6)     # the variants really differ


def test_heavy_ball_variant():
    y, x, v = [torch.ones(1)], [torch.ones(1)], [torch.full((1,), 2.0)]
    parle_inner_step_(y, [torch.ones(1)], x, v, lr=0.1, gamma_inv=0.0, weight_decay=0.0, momentum=0.5, nesterov=False)
    assert torch.allclose(v[0], torch.tensor([2.0])) and torch.allclose(y[0], torch.tensor([1 - 0.2]))


@pytest.mark.parametrize("start,cap,s,nb", [(0.01, 1.0, 0.5, 468), (1.0, 10.0, 0.5, 100), (0.3, 0.3, 0.5, 7),
                                            (0.0, 1.0, 0.5, 10)])
def test_coupling_closed_form_and_cap(start, cap, s, nb):
    for k in [0, 1, 2, 10, 100, 1000, 10000, 10**6]:
        want = min(start * (1 + s / nb) ** k, cap) if k < 10**5 else cap if start > 0 else 0.0
        assert coupling(k, start=start, cap=cap, scoping=s, nb=nb) == pytest.approx(want, rel=1e-12, abs=0)
    # monotone, and reaches the cap when start > 0
    vals = [coupling(k, start=start, cap=cap, scoping=s, nb=nb) for k in range(0, 50000, 97)]
    assert vals == sorted(vals)
    if start > 0:
        assert vals[-1] == cap


def test_scoping_pair_and_default_caps():
    gk, rk = scoping(10**7, gamma0_inv=0.01, gamma_min_inv=1.0, rho0_inv=1.0, rho_min_inv=10.0, scoping=0.5, nb=468)
    assert (gk, rk) == (1.0, 10.0)
    gk, rk = scoping(3, gamma0_inv=0.01, gamma_min_inv=1.0, rho0_inv=1.0, rho_min_inv=10.0, scoping=0.5, nb=468)
    assert gk == pytest.approx(0.01 * (1 + 0.5 / 468) ** 3, rel=1e-13)
    assert rk == pytest.approx((1 + 0.5 / 468) ** 3, rel=1e-13)


def test_lr_schedules_closed_form():
    assert lr_at(3.0, lr=0.1, schedule="constant") == 0.1
    ms = [2.0, 4.0]
    assert lr_at(1.99, lr=0.1, schedule="step", milestones=ms, decay=0.2) == 0.1
    assert lr_at(2.0, lr=0.1, schedule="step", milestones=ms, decay=0.2) == pytest.approx(0.02)
    assert lr_at(5.0, lr=0.1, schedule="step", milestones=ms, decay=0.2) == pytest.approx(0.004)
    for p in [0.0, 0.25, 1.0, 2.0]:
        assert lr_at(p, lr=0.1, schedule="cosine", total_passes=2.0) == pytest.approx(0.05 * (1 + math.cos(math.pi * p / 2)))
    assert lr_at(0.5, lr=0.1, schedule="constant", warmup_passes=2.0) == pytest.approx(0.025)
    with pytest.raises(ValueError):
        lr_at(1.0, lr=0.1, schedule="linear")


def test_state_dict_roundtrip_continues_identically():
    """Stop after 2 outer steps, restore the weights (x) and both momentum buffers into fresh
    objects, run 2 more: bit-identical to 4 uninterrupted steps. Zeroed buffers would differ.
    The state holds the momentum buffers only: x is the weights then and z restarts from x."""
    n = 2
    b = make_batches(n, 4, 3)
    hp = {**HP, "K": 4, "L": 3}
    lr_sched = lambda k: 0.1
    full, _ = run_parle(x0s(n), b, lr_sched=lr_sched, **hp)
    _, opts = run_parle(x0s(n), b, lr_sched=lr_sched, **{**hp, "K": 2})
    states = [([p.detach().clone() for p in o.params], copy.deepcopy(o.state_dict())) for o in opts]
    assert set(states[0][1]) == {"v_in", "v_out", "hp"} and states[0][1]["v_out"][0].abs().sum() > 0
    resumed, _ = run_parle(x0s(n), b, lr_sched=lr_sched, resume=(2, states), **hp)
    for a in range(n):
        assert torch.equal(resumed[a], full[a])
    zeroed = [(w, {**st, "v_in": [torch.zeros_like(t) for t in st["v_in"]]}) for w, st in states]
    other, _ = run_parle(x0s(n), b, lr_sched=lr_sched, resume=(2, zeroed), **hp)
    assert not torch.equal(other[0], full[0])
    with pytest.raises(ValueError):
        opts[0].load_state_dict({**states[0][1], "v_in": states[0][1]["v_in"][:1]})


@pytest.mark.parametrize("start,cap,end", [(0.01, 1.0, 20.0), (1.0, 10.0, 3.5), (0.3, 0.3, 1.0)])
def test_auto_scoping_reaches_each_cap_at_scoping_end_and_grows_monotonically(start, cap, end):
    vals = [coupling_auto(p, start=start, cap=cap, end_passes=end) for p in [end * i / 997 for i in range(1200)]]
    assert vals == sorted(vals) and vals[0] == start
    assert coupling_auto(end, start=start, cap=cap, end_passes=end) == pytest.approx(cap, rel=1e-9, abs=0)
    assert coupling_auto(end * (1 - 1e-12), start=start, cap=cap, end_passes=end) == pytest.approx(cap, rel=1e-9)
    assert all(v == cap for v in vals[998:])
    assert coupling_auto(end / 2, start=start, cap=cap, end_passes=end) == pytest.approx((start * cap) ** 0.5)
    gk, rk = scoping_auto(end, gamma0_inv=0.01, gamma_min_inv=1.0, rho0_inv=1.0, rho_min_inv=10.0, end_passes=end)
    assert (gk, rk) == (pytest.approx(1.0, rel=1e-9), pytest.approx(10.0, rel=1e-9))


def test_trainer_schedule_auto_and_a_number():
    """scoping=auto through the trainer's schedule: both couplings at their caps at
    scoping_end of the run; a number gives exactly PARLE.md's (1 + s/nb)^k."""
    from parle_hvd.config import make_config
    from parle_hvd.exchange import outer_schedule
    nb, L, epochs = 468, 25, 20.0
    cfg = make_config(None, ["parle.scoping=auto", "parle.scoping_end=0.5"])
    k_end = 0.5 * epochs * nb / L                          # 187.2 outer steps
    steps = [outer_schedule(k, L=L, nb=nb, parle=cfg.parle, optim=cfg.optim, epochs=epochs) for k in range(1, 400)]
    assert [s[0] for s in steps] == sorted(s[0] for s in steps) and [s[1] for s in steps] == sorted(s[1] for s in steps)
    assert all(s[:2] == (1.0, 10.0) for s in steps[int(k_end):]) and steps[int(k_end) - 2][0] < 1.0
    num = make_config(None, ["parle.scoping=0.5"])
    for k in (1, 10, 100):
        assert outer_schedule(k, L=L, nb=nb, parle=num.parle, optim=num.optim, epochs=epochs)[:2] == \
            scoping(k, gamma0_inv=0.01, gamma_min_inv=1.0, rho0_inv=1.0, rho_min_inv=10.0, scoping=0.5, nb=nb)


# --------------------------------------------------------------------------- parle.balance
def _balance_by_hand(sec, total):
    """Largest remainder, written out: shares total*v/sum(v) of the speeds v = 1/sec."""
    v = [1.0 / s for s in sec]
    share = [total * x / sum(v) for x in v]
    out = [int(x) for x in share]
    for a in sorted(range(len(sec)), key=lambda a: -(share[a] - int(share[a])))[:total - sum(out)]:
        out[a] += 1
    return out


@pytest.mark.parametrize("sec", [[2.0, 2.0, 1.0], [1.0, 1.0], [0.013, 0.021, 0.034, 0.055], [1.0, 3.0, 3.0, 9.0]])
@pytest.mark.parametrize("L", [1, 5, 25])
def test_balance_steps_shares_n_times_L_by_speed(sec, L):
    from parle_hvd.parle import balance_steps
    n = len(sec)
    got = balance_steps(sec, total=n * L)
    assert sum(got) == n * L and min(got) >= 1
    want = _balance_by_hand(sec, n * L)
    if min(want) >= 1:                    # no replica needed raising to 1: plain largest remainder
        assert got == want
    # all finish at about the same time: no replica's inner loop is more than one of its
    # steps longer than another's (beyond the steps the floor of 1 forces)
    t = [s * k for s, k in zip(sec, got) if k > 1]
    assert not t or max(t) - min(t) <= max(sec) + 1e-12


def test_balance_steps_edge_cases():
    from parle_hvd.parle import balance_steps
    assert balance_steps([2.0, 2.0, 1.0], total=75) == [19, 19, 37]       # speeds 1/2, 1/2, 1
    assert balance_steps([0.0, 0.0], total=50) == [25, 25]                # not measured yet: equal
    assert balance_steps([1.0, 0.0, float("nan")], total=9) == [3, 3, 3]  # unmeasured count at the mean
    assert balance_steps([1000.0, 1.0, 1.0], total=6) == [1, 3, 2]       # the slow one at its floor of 1
    assert balance_steps([5.0, 1.0], total=2) == [1, 1]                   # every replica at least 1
    with pytest.raises(ValueError):
        balance_steps([1.0, 1.0, 1.0], total=2)
