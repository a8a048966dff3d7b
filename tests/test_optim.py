"""parle_hvd.optim, the public optimizer, on one process (world size 1): what a user's
script relies on. Its multi-rank behaviour is tested through the trainer, which drives the
same object (test_trainer_mr, test_algorithms_mr, test_overlap), and through
examples/own_loop.py (test_examples)."""
import copy

import pytest
import torch
from torch import nn

import parle_hvd
from parle_hvd import optim


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()


def _batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(16, 5, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def _steps(opt, model, start, stop, sched=None):
    for i in range(start, stop):
        x, y = _batch(i)
        loss = nn.functional.mse_loss(getattr(opt, "module", model)(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step(loss=loss) if isinstance(opt, optim.DistributedOptimizer) else opt.step()
        if sched is not None:
            sched.step()


def test_public_names_have_docstrings():
    for name in parle_hvd.__all__:
        assert getattr(parle_hvd, name).__doc__, name
    for name in optim.__all__:
        obj = getattr(optim, name)
        assert isinstance(obj, tuple) or obj.__doc__, name
    for meth in ("step", "next_plan", "synchronize", "reference", "reference_model", "state_dict",
                 "load_state_dict", "register_sync_hook", "start", "module"):
        assert getattr(optim.DistributedOptimizer, meth).__doc__, meth


@pytest.mark.parametrize("args, kw, err, words", [
    (("adam",), {"lr": 0.1}, ValueError, "unknown algorithm 'adam'"),
    (("parle",), {"lr": 0.1, "sync_period": 4, "batches_per_pass": 10, "gamma": 1}, TypeError, "no keyword 'gamma'"),
    (("parle",), {"lr": -1.0, "sync_period": 4, "batches_per_pass": 10}, ValueError, "optim.lr"),
    (("parle",), {"lr": 0.1, "sync_period": 0, "batches_per_pass": 10}, ValueError, "parle.sync_period"),
    (("parle",), {"lr": 0.1, "sync_period": 4}, ValueError, "batches_per_pass"),
    (("localsgd",), {"lr": 0.1, "sync_period": 4, "overlap": True}, ValueError, "parle.overlap"),
    (("diloco",), {"lr": 0.1, "inner": "lion"}, ValueError, "diloco.inner"),
])
def test_make_refuses_bad_input_naming_the_key(args, kw, err, words):
    with pytest.raises(err, match=words.replace("(", r"\(")):
        optim.make(*args, _model(), **kw)


def test_a_torch_lr_scheduler_drives_the_inner_learning_rate():
    """localsgd at world size 1 is SGD-Nesterov: with the same StepLR, its weights equal
    torch.optim.SGD's, so the group's lr is what every step used."""
    a, b = _model(), _model()
    opt = optim.make("localsgd", a, lr=0.2, sync_period=3, momentum=0.9, nesterov=True)
    ref = torch.optim.SGD(b.parameters(), lr=0.2, momentum=0.9, nesterov=True)
    s1 = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=4, gamma=0.5)
    _steps(opt, a, 0, 10, s1)
    _steps(ref, b, 0, 10, s2)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 0.2 * 0.5 ** 2
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert opt.k == 3 and opt.j == 1           # 10 inner steps: 3 outer steps of 3, one step into the 4th


@pytest.mark.parametrize("algo", ["parle", "localsgd", "diloco", "entropy", "elastic", "sgd"])
def test_state_dict_resumes_exactly_mid_outer_step(algo):
    """Saved after 6 inner steps (L=4: two steps into outer step 2) with the model's own
    state_dict, loaded into a new model and optimizer: steps 7..13 give the same weights,
    to the bit, as the uninterrupted run."""
    kw = {"lr": 0.05, "sync_period": 4, "batches_per_pass": 8}
    a = _model()
    opt = optim.make(algo, a, **kw)
    _steps(opt, a, 0, 6)
    saved = copy.deepcopy({"model": a.state_dict(), "opt": opt.state_dict()})
    _steps(opt, a, 6, 13)
    b = _model(seed=5)                           # other weights: all must come from the state
    opt2 = optim.make(algo, b, **kw)
    b.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _steps(opt2, b, 6, 13)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), (algo, n)
    assert (opt.k, opt.j) == (opt2.k, opt2.j) == (3, 1)


def test_reference_is_swapped_in_and_the_replica_restored():
    m = _model()
    opt = optim.make("parle", m, lr=0.1, sync_period=2, batches_per_pass=4)
    _steps(opt, m, 0, 5)
    replica = copy.deepcopy(m.state_dict())
    ref = copy.deepcopy(opt.reference_model().state_dict())
    assert any(not torch.equal(replica[k], ref[k]) for k in replica)      # x[a] has moved off the reference
    with opt.reference() as inside:         # weights and BatchNorm statistics (not its int counter)
        assert inside is m and all(torch.equal(v, ref[k]) for k, v in m.state_dict().items() if v.is_floating_point())
    assert all(torch.equal(v, replica[k]) for k, v in m.state_dict().items())


def test_closure_and_sync_hooks():
    m = _model()
    opt = optim.make("localsgd", m, lr=0.1, sync_period=2)
    seen = []
    opt.register_sync_hook(lambda r: seen.append((r.step, r.plan.steps, float(r.rows[0, 0]))))
    x, y = _batch(0)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(opt.module(x), y)
        loss.backward()
        return loss
    losses = [float(opt.step(closure).detach()) for _ in range(4)]
    assert [s[:2] for s in seen] == [(1, (2,)), (2, (2,))]
    assert seen[0][2] == pytest.approx(sum(losses[:2]) / 2) and seen[1][2] == pytest.approx(sum(losses[2:]) / 2)


def test_a_non_finite_loss_stops_at_the_sync():
    m = _model()
    opt = optim.make("localsgd", m, lr=0.1, sync_period=2)
    x, y = _batch(0)
    opt.step(loss=torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(optim.NonFiniteError, match="outer step 1"):
        opt.step(loss=torch.tensor(float("nan"), dtype=torch.float64))


def test_backend_none_under_launcher_variables_runs_alone_on_purpose(monkeypatch):
    """dist.backend=none (one process, knowingly) still trains when launcher variables are
    set (a pytest run under mpirun, srun -n1): only a process that never called init() is
    refused, since n such processes would each train alone."""
    from parle_hvd import comm
    monkeypatch.setenv("PMIX_RANK", "0")
    monkeypatch.setattr(comm, "_init_called", False)
    with pytest.raises(RuntimeError, match="call parle_hvd.init"):
        optim.make("localsgd", _model(), lr=0.1, sync_period=2)
    comm.init("none", set_threads=False)
    opt = optim.make("localsgd", _model(), lr=0.1, sync_period=2)
    assert opt.world == 1 and opt.k == 0 and opt.started


def test_state_dict_before_the_first_step_loads():
    a = _model()
    opt = optim.make("parle", a, lr=0.1, sync_period=2, batches_per_pass=4)
    saved = copy.deepcopy({"model": a.state_dict(), "opt": opt.state_dict()})
    b = _model(seed=3)
    opt2 = optim.make("parle", b, lr=0.1, sync_period=2, batches_per_pass=4)
    b.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _steps(opt, a, 0, 5)
    _steps(opt2, b, 0, 5)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
