"""Compute overhead of one Parle replica vs plain single-process SGD.

Same model (LeNet), batch (128), data (Fashion-MNIST-shaped), threads and number of
mini-batches; Parle's extra work is the coupling term and z average in every inner step
and the outer step every L steps. Both loops run in this process, interleaved in rounds,
and the figure is the ratio of their throughputs measured in the same run.

    python -m bench.overhead [--quick]
    target: overhead_ratio >= 0.95
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import emit
from parle_hvd.models import build_model
from parle_hvd.parle import Parle


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    steps, rounds = (100, 3) if a.quick else (500, 5)
    L, bs = 25, 128
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(16, bs, 1, 28, 28, generator=g)
    ys = torch.randint(0, 10, (16, bs), generator=g)

    def run(kind: str) -> float:
        torch.manual_seed(0)
        m = build_model("lenet", num_classes=10, in_channels=1, image_size=28)
        if kind == "sgd":
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        else:
            opt = Parle(m.parameters(), inner_lr=0.01, sync_period=L)
            xbar = [p.detach().clone() for p in m.parameters()]
        t = time.perf_counter()
        for i in range(steps):
            if kind == "parle" and i % L == 0:
                opt.begin_outer()
            out = m(xs[i % 16])
            loss = F.cross_entropy(out, ys[i % 16])
            m.zero_grad(set_to_none=True)
            loss.backward()
            if kind == "sgd":
                opt.step()
            else:
                opt.inner_step(gamma_inv=0.01)
                if i % L == L - 1:
                    opt.outer_step(xbar, rho_inv=1.0, lr=0.01)
        return steps * bs / (time.perf_counter() - t)

    run("sgd"), run("parle")      # warm-up
    sgd, parle = [], []
    for _ in range(rounds):        # interleaved, so drifts in machine load hit both
        sgd.append(run("sgd"))
        parle.append(run("parle"))
    s, p = max(sgd), max(parle)
    emit("overhead_sgd_samples_per_sec", s)
    emit("overhead_parle_samples_per_sec", p)
    emit("overhead_ratio", p / s)
    emit("overhead_target_met", int(p / s >= 0.95))


if __name__ == "__main__":
    main()
