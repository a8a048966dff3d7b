"""Cost of an elastic-mode commit against the outer step it follows.

In elastic mode each rank copies its whole state to host memory at the end of every outer
step (``Membership.commit``: model, reference, Parle's x, z and two momentum buffers, and
the small rest). This times that copy for each model and, in the same run, one inner
step (forward, backward, Parle's inner step) at batch 128, and prints the commit's share
of an outer step of L = 25 inner steps.

    python -m bench.commit_cost [--quick]
    no target; docs/robustness.md quotes the figures
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from bench.common import emit
from parle_hvd.models import build_model
from parle_hvd.parle import Parle
from parle_hvd.membership import host_copy

SHAPES = {"lenet": (1, 28), "allcnn": (3, 32), "resnet18": (3, 32)}


def _best(fn, n: int) -> float:
    fn()                                    # warm-up
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    L, bs = 25, 128
    for name in (("lenet", "allcnn") if a.quick else ("lenet", "allcnn", "resnet18")):
        c, hw = SHAPES[name]
        torch.manual_seed(0)
        m = build_model(name, num_classes=10, in_channels=c, image_size=hw)
        ref = copy.deepcopy(m)
        opt = Parle(list(m.parameters()), inner_lr=0.01, sync_period=L)
        x, y = torch.randn(bs, c, hw, hw), torch.randint(0, 10, (bs,))

        def commit():
            # what Trainer.state_dict() holds, as Membership.commit copies it
            host_copy({"model": m.state_dict(), "ref": ref.state_dict(), "algo_state": {"parle": opt.state_dict()}})

        def inner():
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            opt.inner_step(gamma_inv=0.01)

        opt.begin_outer()
        t_commit = _best(commit, 3 if a.quick else 5)
        t_inner = _best(inner, 2 if a.quick else 3)
        emit(f"commit_{name}_ms", 1e3 * t_commit)
        emit(f"commit_{name}_mbytes", sum(p.numel() * p.element_size() for p in m.parameters()) * 6 / 1e6)
        emit(f"commit_{name}_inner_step_ms", 1e3 * t_inner)
        emit(f"commit_{name}_share_of_outer_step", t_commit / (t_commit + L * t_inner))


if __name__ == "__main__":
    main()
