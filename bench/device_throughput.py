"""Samples per second of every algorithm's compute on one device, beside plain SGD (issue 14).

One process, world size 1: each algorithm runs the trainer's outer step exactly as
``Trainer.loop`` drives it (begin_outer, L inner steps of forward, backward and
``inner_step``, end_outer, after_sync; the sync itself is a no-op at world size 1, so
this is the compute, not the communication). Batches are synthetic, made once on the
device (no host-to-device copy per step), for LeNet on Fashion-MNIST-shaped input and
All-CNN-C and ResNet-18 on CIFAR-shaped input. Plain SGD (torch.optim.SGD, the same
model, batches and number of steps) runs in the same process, interleaved in rounds, and
each algorithm's figure is printed with its ratio to it (Parle's target: >= 0.95).

    python -m bench.device_throughput [--device auto|cpu|cuda] [--tiny] [--steps 100] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import emit
from parle_hvd.algorithms import ALGORITHMS, make_algorithm
from parle_hvd.config import make_config
from parle_hvd.models import build_model, sync_tensors

MODELS = {"lenet": (1, 28), "allcnn": (3, 32), "resnet18": (3, 32)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(algo: str, model_name: str, dev: torch.device, *, bs: int, steps: int, L: int) -> float:
    """Samples per second of ``steps`` inner steps of ``algo`` (``sgd_plain``: torch.optim.SGD alone)."""
    c, hw = MODELS[model_name]
    g = torch.Generator(device=dev).manual_seed(0) if dev.type == "cuda" else torch.Generator().manual_seed(0)
    xs = torch.randn(8, bs, c, hw, hw, generator=g, device=dev)
    ys = torch.randint(0, 10, (8, bs), generator=g, device=dev)
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10, in_channels=c, image_size=hw).to(dev)
    ref = build_model(model_name, num_classes=10, in_channels=c, image_size=hw).to(dev)
    ref.load_state_dict(model.state_dict())
    model.train()
    if algo == "sgd_plain":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)

        def outer(n):
            for i in range(n):
                loss = F.cross_entropy(model(xs[i % 8]), ys[i % 8])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    else:
        over = [f"algo={algo}", f"parle.sync_period={L}", f"localsgd.sync_period={L}", f"diloco.sync_period={L}",
                f"train.block={L}", "optim.weight_decay=1e-4", "dist.backend=none"]
        cfg = make_config(None, over)
        a = make_algorithm(algo, model, cfg, 1, 0)
        model_t, ref_t, xbar = sync_tensors(model), sync_tensors(ref), list(ref.parameters())

        def outer(n):
            done = 0
            while done < n:
                a.begin_outer()
                for _ in range(a.L):
                    loss = F.cross_entropy(model(xs[done % 8]), ys[done % 8])
                    model.zero_grad(set_to_none=True)
                    loss.backward()
                    a.inner_step(gk=0.1, rk=1.0, lr=0.01, xbar=xbar)
                    done += 1
                a.end_outer(xbar, rk=1.0, lr=0.01)
                if a.syncs:
                    with torch.no_grad():
                        for r, m in zip(ref_t, model_t):
                            r.copy_(m)                     # the reference at world size 1
                    a.after_sync(model_t, ref_t)
    outer(min(steps, 2 * L))                              # warm-up (cuDNN autotune, allocator)
    _sync(dev)
    t0 = time.perf_counter()
    outer(steps)
    _sync(dev)
    return steps * bs / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.device_throughput", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="LeNet only, few steps (the dry run of launch/gpu_check.sh)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       "cpu" if a.device == "auto" else a.device)
    emit("device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)")
    models = ["lenet"] if a.tiny else list(MODELS)
    steps, rounds, L = (10, 1, 5) if a.tiny else (a.steps, a.rounds, 25)
    algos = ["sgd_plain", *ALGORITHMS]
    for m in models:
        best = {k: 0.0 for k in algos}
        for _ in range(rounds):                              # interleaved: drift hits every algorithm alike
            for k in algos:
                best[k] = max(best[k], measure(k, m, dev, bs=a.batch, steps=steps, L=L))
        for k in algos:
            emit(f"{m}_{k}_samples_per_sec", best[k])
            if k != "sgd_plain":
                emit(f"{m}_{k}_ratio_to_sgd", best[k] / best["sgd_plain"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
