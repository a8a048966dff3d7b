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
from parle_hvd.exchange import outer_schedule
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
    # the time spent evaluating is counted (time to accuracy leaves it out), grows, and is part of the wall time
    ev = [l["train/eval_seconds"] for l in lines if "val/accuracy" in l]
    assert 0 < ev[0] < ev[1] == summ["eval_seconds"] < summ["wall_seconds"]
    assert all(l["train/eval_seconds"] < l["train/wall_seconds"] for l in lines if "val/accuracy" in l)
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
    # what resume needs, no more: x is the model's weights between outer steps, z restarts from it
    assert set(st["algo_state"]["parle"]) == {"v_in", "v_out", "hp"}
    # every file loads weights only (no pickled numpy objects), and final.pt into the model's
    # own class, with what inference needs beside it in final.json
    for f in (tmp_path / "checkpoints").glob("step-*/rank-*.pt"):
        assert torch.load(f, weights_only=True)["step"] in (2, 4)
    card = json.loads((tmp_path / "final.json").read_text())
    ds = load_dataset("fashion-mnist", str(FASHION))
    assert card["input"] == {"shape": [1, 28, 28], "dtype": "uint8", "mean": list(ds.mean), "std": list(ds.std),
                             "resize": None, "crop_frac": None}
    assert card["model"]["name"] == "lenet" and card["num_classes"] == 10 and card["config"] == summ["config"]
    net = build_model("lenet", num_classes=10, in_channels=1, image_size=28)
    net.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True))
    x = to_input(ds.test_x[:500], card["input"]["mean"], card["input"]["std"])
    acc = float((net.eval()(x).argmax(1) == ds.test_y[:500]).float().mean())
    assert acc == pytest.approx(summ["test_accuracy"], abs=0.05), (acc, summ["test_accuracy"])


def test_every_algorithm_scopes_on_the_same_clock_of_passes():
    """Elastic-SGD (tau = 1: one outer step per inner step) has, after the same number of
    passes, exactly the couplings Parle (L = 25) has: k counted in Parle outer steps."""
    cfg = make_config(None, [])
    P, O = cfg.parle, cfg.optim
    nb = 468
    for m in (1, 7, 40, 200):
        parle = outer_schedule(m, L=P.sync_period, nb=nb, parle=P, optim=O, epochs=10)
        elastic = outer_schedule(m * P.sync_period, L=1, nb=nb, parle=P, optim=O, epochs=10)
        assert elastic[:2] == pytest.approx(parle[:2], rel=1e-12, abs=0), m
    # and Parle's own is PARLE.md's (1 + s/nb)^k in outer steps
    gk, rk, _ = outer_schedule(3, L=25, nb=nb, parle=P, optim=O, epochs=10)
    assert gk == pytest.approx(0.01 * (1 + 0.5 / nb) ** 3, rel=1e-13) and rk == pytest.approx((1 + 0.5 / nb) ** 3, rel=1e-13)
    # Elastic-SGD's cap after ~115 passes like Parle's, not after ~4.6
    assert outer_schedule(int(10 * nb), L=1, nb=nb, parle=P, optim=O, epochs=200)[1] < P.rho_min_inv


def test_lr_is_read_at_the_middle_of_the_outer_step():
    """A warm-up gives the first outer step a positive lr (the middle of the step), and a
    milestone applies from the first step whose middle passes it."""
    cfg = make_config(None, ["optim.warmup_passes=1.0", "optim.schedule=constant"])
    L, nb = 25, 100                                       # 4 outer steps per pass
    lr1 = outer_schedule(1, L=L, nb=nb, parle=cfg.parle, optim=cfg.optim, epochs=10)[2]
    assert lr1 == pytest.approx(0.1 * (0.5 * 25 / 100) / 1.0)
    cfg = make_config(None, ["optim.schedule=step", "optim.milestones=[1.0]", "optim.decay=0.1"])
    lrs = [outer_schedule(k, L=L, nb=nb, parle=cfg.parle, optim=cfg.optim, epochs=10)[2] for k in range(1, 7)]
    # step k covers passes [(k-1)/4, k/4]; its middle (k-0.5)/4 passes 1.0 from step 5 on
    assert lrs[:4] == [0.1] * 4 and lrs[4:] == pytest.approx([0.01, 0.01])


def test_recompute_bn_is_the_cumulative_mean_and_variance_of_the_chosen_batches():
    """The reference's BatchNorm statistics become the plain average, over the chosen
    training batches (a shuffle seeded by seed and step), of each batch's mean and unbiased
    variance; dropout is off while they are measured; the replica is not touched; the
    reference ends in eval mode with its BatchNorm momentum as before."""
    import copy
    from types import SimpleNamespace
    from torch import nn
    from parle_hvd.data import _gen
    from parle_hvd.evaluation import recompute_bn
    g = torch.Generator().manual_seed(0)
    ds = SimpleNamespace(train_x=torch.randint(0, 256, (200, 2, 5, 5), generator=g, dtype=torch.uint8),
                         train_y=torch.zeros(200, dtype=torch.int64), n_train=200, mean=(0.4, 0.5), std=(0.2, 0.3))
    torch.manual_seed(1)
    replica = nn.Sequential(nn.Dropout(0.5), nn.BatchNorm2d(2, momentum=0.3), nn.Flatten(), nn.Linear(50, 3))
    replica[1].running_mean.fill_(7.0)
    before = {k: v.clone() for k, v in replica.state_dict().items()}
    ref = copy.deepcopy(replica)
    recompute_bn(ref, ds, batches=3, batch_size=16, seed=42, step=5, dtype=torch.float32, dev=torch.device("cpu"))
    perm = torch.randperm(200, generator=_gen("bn", 42, 5))
    xs = [to_input(ds.train_x[perm[i * 16:(i + 1) * 16]], ds.mean, ds.std) for i in range(3)]
    mean = sum(x.mean(dim=(0, 2, 3)) for x in xs) / 3
    var = sum(x.transpose(0, 1).reshape(2, -1).var(dim=1, unbiased=True) for x in xs) / 3
    bn = ref[1]
    assert torch.allclose(bn.running_mean, mean, atol=1e-6) and torch.allclose(bn.running_var, var, atol=1e-6)
    assert bn.momentum == 0.3 and not ref.training
    for k, v in replica.state_dict().items():
        assert torch.equal(v, before[k]), k


@needs_fashion
def test_checkpoint_holds_what_resume_needs_and_no_more(tmp_path):
    """A Parle checkpoint carries the replica (x), the reference and the two momentum
    buffers: 4 copies of the model, not 6 (x and z are not saved twice)."""
    train(_cfg(tmp_path, "data.train_limit=640", "data.test_limit=100", "parle.sync_period=4",
               "train.batch_size=32", "train.epochs=0.4", "eval.bn_batches=1"))
    st = torch.load(tmp_path / "checkpoints/step-00000002/rank-0.pt", weights_only=False)
    tensors = lambda o: ([o] if isinstance(o, torch.Tensor) else
                         [t for v in (o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else [])
                          for t in tensors(v)])
    model_bytes = sum(t.numel() * t.element_size() for t in st["model"].values())
    total = sum(t.numel() * t.element_size() for k, v in st.items() if k not in ("rng_torch", "aug_gen")
                for t in tensors(v))
    assert 3.9 * model_bytes < total < 4.05 * model_bytes, total / model_bytes


@needs_fashion
def test_validation_split_is_evaluated_beside_the_test_set(tmp_path):
    """data.val_frac: the held-out part leaves the training data (fewer batches per pass),
    every evaluation reports valid/* beside the test set's val/*, and summary.json has both."""
    s = train(_cfg(tmp_path, "data.train_limit=1000", "data.test_limit=200", "data.val_frac=0.2",
                   "parle.sync_period=5", "train.batch_size=50", "train.epochs=1", "eval.every=0.5",
                   "eval.bn_batches=1"))
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["batches_per_pass"] == 800 // 50
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ev = [l for l in lines if "val/accuracy" in l]
    assert len(ev) == s["evaluations"] == 2 and all("valid/accuracy" in l and "valid/error" in l for l in ev)
    assert s["valid_accuracy"] == ev[-1]["valid/accuracy"] and 0 < s["valid_accuracy"] < 1
    assert s["test_accuracy"] == s["val_accuracy"] == ev[-1]["val/accuracy"]
    assert math.isfinite(s["valid_loss"]) and s["valid_accuracy"] != s["test_accuracy"]


@needs_fashion
def test_batches_on_the_models_device_and_the_data_moved_once(tmp_path, monkeypatch):
    """Issue 14: the data goes to the rank's device once (data.to_device, at build), every
    batch's indices and images come out on the model's device, and the training tensor is
    the same storage from the first step to the last (no copy per step)."""
    import parle_hvd.trainer as tr
    from parle_hvd.data import to_device as real_to_device
    moves, seen = [], []
    monkeypatch.setattr(tr, "to_device", lambda ds, dev: moves.append(dev) or real_to_device(ds, dev))
    real_next = ReplicaSampler.next

    def spy(self):
        b = real_next(self)
        seen.append((b.device, trainer.ds.train_x.data_ptr(), trainer.ds.train_x[b].device))
        return b
    monkeypatch.setattr(ReplicaSampler, "next", spy)
    cfg = _cfg(tmp_path, "data.train_limit=640", "data.test_limit=100", "parle.sync_period=4", "train.batch_size=32",
               "train.epochs=1", "data.augment=true", "dist.device=cpu")
    trainer = tr.Trainer(cfg)
    trainer.run()
    dev = next(trainer.model.parameters()).device
    assert moves == [dev]                                   # once, to the model's device
    assert len(seen) == 20 and {s[0] for s in seen} == {dev} and {s[2] for s in seen} == {dev}
    assert len({s[1] for s in seen}) == 1                  # one storage: nothing copied per step


def test_inner_loop_timer_on_a_gpu_waits_for_its_own_stream_not_the_device(monkeypatch):
    """parle.balance on a GPU: with parle.overlap the previous sync's allreduce is queued on
    the device and waits for the slowest rank, so a device-wide torch.cuda.synchronize gave
    the fast replica the slow one's time. The timer records CUDA events on the loop's stream,
    waits for that stream alone, under the watchdog's guard, and reads the events' time.
    (Fake events: no GPU here; launch/gpu_check.sh runs the real thing.)"""
    import contextlib
    from parle_hvd import optim
    calls = []

    class Event:
        clock = 0.0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            Event.clock += 0.75                # 0.75 s of device work between the two records
            self.t = Event.clock
            calls.append("record")

        def synchronize(self):
            calls.append("wait for the stream")

        def elapsed_time(self, end):           # milliseconds, as CUDA's
            return (end.t - self.t) * 1000.0

    def device_wide(*a, **k):
        raise AssertionError("torch.cuda.synchronize: waits for the sync's allreduce too")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)

    @contextlib.contextmanager
    def guard():
        calls.append("watchdog on")
        yield
        calls.append("watchdog off")

    timer = optim.InnerTimer(torch.device("cuda", 0))
    assert timer.seconds(guard()) == pytest.approx(0.75)
    assert calls == ["record", "watchdog on", "record", "wait for the stream", "watchdog off"]
    cpu = optim.InnerTimer(torch.device("cpu"))          # on the CPU: host time, no events
    assert 0 <= cpu.seconds() < 5 and calls[-1] == "watchdog off"


@needs_fashion
def test_a_run_gives_back_the_signal_handlers_and_ends_its_watchdog(tmp_path, monkeypatch):
    """After train(cfg) returns (or raises), SIGTERM and SIGINT mean what they meant before
    (a script that goes on after a run, or runs another), and the watchdog's thread is over."""
    import signal
    import threading
    from parle_hvd.data import DataError
    from parle_hvd.watchdog import Watchdog

    closed = []
    monkeypatch.setattr(Watchdog, "close", lambda self: closed.append(self) or self._closed.set())
    mine = lambda signum, frame: None  # noqa: E731
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGINT)}
    small = ["data.train_limit=256", "data.test_limit=100", "train.epochs=1"]
    try:
        train(_cfg(tmp_path / "a", *small))
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
        assert len(closed) == 1                                  # the run's own watchdog
        train(_cfg(tmp_path / "k", *small), give_back_signals=False)      # train.py's way: its process ends next
        assert signal.getsignal(signal.SIGTERM) is not mine
        signal.signal(signal.SIGTERM, mine)
        signal.signal(signal.SIGINT, mine)
        bad = _cfg(tmp_path / "b", "data.train_limit=256", "data.test_limit=100", "train.epochs=1",
                   "data.name=folder", f"data.dir={tmp_path / 'none'}")
        with pytest.raises(DataError):    # a run that fails (its data folder is missing) gives them back too
            train(bad)
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    others = set(threading.enumerate())
    dog = Watchdog(5.0, 0, 2)            # two ranks: its thread runs
    (t,) = [x for x in threading.enumerate() if x not in others and x.name == "parle-watchdog"]
    Watchdog.close(dog)
    t.join(2.0)
    assert not t.is_alive()


def test_logger_writes_a_missing_row_once_after_an_elastic_reset(tmp_path):
    """Elastic mode: rank 0 may be lost after a step's commit but before it wrote the step's
    row; the new rank 0 reopens the log at the committed step and writes that row once."""
    from parle_hvd.logger import RunLogger
    log = RunLogger(tmp_path, enabled=True, tensorboard=False, progress="lines", total=10)
    for k in (5, 10, 15):
        log.scalars(k, {"train/loss": 1.0 / k})
    log.scalars(20, {"val/accuracy": 0.5})            # an evaluation row at the committed step
    log.scalars(25, {"train/loss": 0.04})             # a step after the commit: replayed
    log.close()
    log = RunLogger(tmp_path, enabled=True, tensorboard=False, progress="lines", total=30, start_step=20)
    log.ensure_row(15, {"train/loss": 0.5})           # present: not written again
    log.ensure_row(20, {"train/loss": 0.05})          # missing (the evaluation row does not count): written
    log.ensure_row(20, {"train/loss": 0.05})
    log.close()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("train/loss")) for r in rows] == [(5, 0.2), (10, 0.1), (15, 1 / 15), (20, None),
                                                                 (20, 0.05)]
    RunLogger(tmp_path, enabled=False, tensorboard=False, progress="lines", total=1).ensure_row(25, {"a": 1})  # a no-op off rank 0


def test_an_elastic_commit_keeps_the_committed_steps_row_only():
    """Membership.commit keeps the row of the step it commits (for a new rank 0 to write),
    never an older one."""
    from types import SimpleNamespace
    from parle_hvd.membership import Membership
    t = SimpleNamespace(built=True, k=25, last_row=(25, {"train/loss": 0.3}), state_dict=lambda: {"w": torch.ones(2)})
    m = Membership(t, restarts=True)
    m.commit()
    assert m.committed_row == (25, {"train/loss": 0.3}) and torch.equal(m.committed["w"], torch.ones(2))
    t.k = 27                                 # step 27 was not a logged one: its commit has no row
    m.commit()
    assert m.committed_row is None
