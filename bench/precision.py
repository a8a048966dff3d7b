"""Mixed precision and torch.compile through the real trainer (issue 24), side by side.

Part 1, speed: samples/s of one replica's inner steps (the trainer's own ``perf/step_ms``:
forward, backward and update of one inner step, measured by the optimizer) for fp32, bf16,
compiled fp32 and compiled bf16, for LeNet (Fashion-MNIST-shaped input), All-CNN-C and
ResNet-18 (CIFAR-shaped), in 3 rounds that alternate the variants. Each run is one
process of train.py (``dist.backend=none``) on synthetic in-memory images; its first
outer step (which holds the compile) is dropped, the median of the others is taken, and
each variant is printed with its ratio to fp32 measured in the same round. The compile
time is the first outer step's extra seconds.

Part 2, accuracy: ``make run``'s preset (configs/fashion_parle.yaml, 2 ranks, horovodrun
--gloo) at a budget this machine can afford (``--train-limit`` images, ``--epochs``
passes), under fp32, bf16 and compiled fp32, over 3 seeds: the final test error of each,
and the paired difference to fp32 over the same seeds with its 95 % Student-t interval.

    python -m bench.precision [--quick] [--rounds 3] [--seeds 3] [--part speed|accuracy|both]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import TensorDataset

from bench.common import emit, metrics, tmpdir, train
from parle_hvd.compare import mean_ci

SHAPES = {"lenet": (1, 28), "allcnn": (3, 32), "resnet18": (3, 32)}
# (batch, inner steps per outer step, outer steps) per model: the conv nets run at about
# 30-100 images/s on this CPU (fp32; bf16 slower), so fewer, smaller steps
SIZES = {"lenet": (64, 4, 5), "allcnn": (32, 2, 4), "resnet18": (32, 2, 4)}
VARIANTS = {"fp32": ["train.precision=fp32"], "bf16": ["train.precision=bf16"],
            "compile_fp32": ["train.precision=fp32", "train.compile=true"],
            "compile_bf16": ["train.precision=bf16", "train.compile=true"]}


def images(n_train: int = 512, n_test: int = 64, channels: int = 3, size: int = 32, seed: int = 0):
    """Synthetic labelled images (data.target=bench.precision:images): speed only."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda n: TensorDataset(torch.rand(n, channels, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))
    return mk(n_train), mk(n_test)


def speed_run(model: str, variant: str, *, bs: int, L: int, outer: int) -> tuple[float, float]:
    """(samples/s over outer steps 2.., the first outer step's extra seconds) of one run."""
    c, hw = SHAPES[model]
    d = tmpdir(f"prec_{model}_{variant}")
    args = ["--config", "configs/fashion_parle.yaml", f"model.name={model}", "data.target=bench.precision:images",
            f"data.kwargs={{n_train: {bs * L * outer}, n_test: {bs}, channels: {c}, size: {hw}}}",
            f"train.batch_size={bs}", f"parle.sync_period={L}", "train.epochs=1", "run.log_every=1",
            "eval.every=100", "eval.bn_batches=0", "run.ckpt_every=0", "run.tensorboard=false", "dist.backend=none",
            "dist.threads=2", *VARIANTS[variant]]
    train(args, np=1, run_dir=d)
    ms = [m["perf/step_ms"] for m in metrics(d) if "perf/step_ms" in m]
    steady = statistics.median(ms[1:])
    return bs * 1000.0 / steady, (ms[0] - steady) * L / 1000.0


def part_speed(a) -> None:
    for model in a.models:
        sps = {v: [] for v in a.variants}
        ratio = {v: [] for v in a.variants}
        first = {}
        for r in range(a.rounds):
            order = list(a.variants) if r % 2 == 0 else list(reversed(a.variants))   # alternate, both directions
            got = {}
            for v in order:
                bs, L, outer = SIZES[model] if a.outer is None else (a.bs, a.L, a.outer)
                got[v], extra = speed_run(model, v, bs=bs, L=L, outer=outer)
                first.setdefault(v, extra)
                sps[v].append(got[v])
            for v in a.variants:
                ratio[v].append(got[v] / got["fp32"])
        for v in a.variants:
            emit(f"{model}.{v}.samples_per_sec", statistics.median(sps[v]), f"(rounds {[round(x, 1) for x in sps[v]]})")
            emit(f"{model}.{v}.vs_fp32", statistics.median(ratio[v]), f"(per round {[round(x, 3) for x in ratio[v]]})")
            if v.startswith("compile"):
                emit(f"{model}.{v}.compile_seconds_first_run", first[v])


def part_accuracy(a) -> None:
    variants = {"fp32": [], "bf16": ["train.precision=bf16"], "compile_fp32": ["train.compile=true"]}
    err = {v: [] for v in variants}
    for s in range(a.seeds):
        for v, over in variants.items():
            d = tmpdir(f"prec_acc_{v}_s{s}")
            t0 = time.monotonic()
            summ = train(["--config", "configs/fashion_parle.yaml", f"data.train_limit={a.train_limit}",
                          "data.test_limit=10000", f"train.epochs={a.epochs}", "parle.sync_period=25",
                          "train.batch_size=128", f"train.seed={42 + s}", "eval.every=1", "run.ckpt_every=0",
                          "run.tensorboard=false", "dist.threads=1", *over], np=2, run_dir=d)
            err[v].append(1.0 - summ["test_accuracy"])
            emit(f"accuracy.{v}.seed{42 + s}.test_error", err[v][-1], f"({time.monotonic() - t0:.0f} s)")
    for v in variants:
        m, h, n = mean_ci(err[v])
        emit(f"accuracy.{v}.test_error_mean", m, f"+- {h:.4f} (95 %, n={n})")
        if v != "fp32":
            dm, dh, _ = mean_ci([x - y for x, y in zip(err[v], err["fp32"])])
            verdict = "no difference" if abs(dm) <= dh else ("worse" if dm > 0 else "better")
            emit(f"accuracy.{v}.minus_fp32", dm, f"+- {dh:.4f} (paired, 95 %): {verdict}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="LeNet only, 1 round, 1 seed, a tiny budget")
    p.add_argument("--part", choices=["speed", "accuracy", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--bs", type=int, default=64, help="with --outer: every model's batch (default: SIZES)")
    p.add_argument("--L", type=int, default=4, help="with --outer: inner steps per outer step")
    p.add_argument("--outer", type=int, default=None, help="outer steps per speed run (default: SIZES)")
    p.add_argument("--models", default="lenet,allcnn,resnet18")
    p.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS) + " (fp32 always runs)")
    p.add_argument("--train-limit", type=int, default=12000)
    p.add_argument("--epochs", type=float, default=2.0)
    a = p.parse_args(argv)
    a.models = a.models.split(",")
    a.variants = ["fp32", *[v for v in a.variants.split(",") if v != "fp32"]]
    unknown = set(a.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    if a.quick:
        a.models, a.rounds, a.seeds, a.outer, a.train_limit, a.epochs = ["lenet"], 1, 1, 3, 2560, 0.5
    emit("device", "cpu", f"({torch.get_num_threads()} threads, torch {torch.__version__})")
    if a.part in ("speed", "both"):
        part_speed(a)
    if a.part in ("accuracy", "both"):
        part_accuracy(a)


if __name__ == "__main__":
    main()
