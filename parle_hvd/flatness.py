"""How flat is a minimum: the rise in training loss under random, filter-normalised weight
perturbations (Li, Xu, Taylor, Studer, Goldstein 2018, "Visualizing the loss landscape of
neural nets", arXiv 1712.09913). The paper's RQ4 (flat minima) is measured with it.

    python -m parle_hvd.flatness RUN_DIR [RUN_DIR ...] [--sizes 0.05,0.1,0.2] [--draws 8] [--batches 20]

For each relative size ``eps`` and each of ``draws`` Gaussian directions ``d`` (one stream
per draw, seeded): every filter of ``d`` (a conv weight's output channel, a linear
weight's row) is scaled to the norm of the same filter of the weights, biases and
BatchNorm parameters get no perturbation (as in Li et al.), and the rise is
``L(w + eps*d) - L(w)`` on fixed training batches, the network in eval mode. Reported:
the mean rise and its standard deviation over the draws, per size. Pure torch: no
collective, one process.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def filter_normalized_direction(model: nn.Module, generator: torch.Generator) -> dict:
    """A random direction over the model's parameters, each filter scaled to its weights'
    filter norm; zero for 1-d parameters (biases, BatchNorm scale and shift)."""
    d = {}
    for name, p in model.named_parameters():
        if p.dim() <= 1:
            d[name] = torch.zeros_like(p)
            continue
        r = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)
        rf, pf = r.reshape(p.shape[0], -1), p.reshape(p.shape[0], -1)
        scale = pf.norm(dim=1, keepdim=True) / rf.norm(dim=1, keepdim=True).clamp_min(1e-12)
        d[name] = (rf * scale).view_as(p)
    return d


@torch.no_grad()
def mean_loss(model: nn.Module, batches: list) -> float:
    model.eval()
    tot = n = 0.0
    for x, y in batches:
        tot += float(F.cross_entropy(model(x), y, reduction="sum"))
        n += len(y)
    return tot / n


@torch.no_grad()
def loss_rise(model: nn.Module, batches: list, *, sizes=(0.05, 0.1, 0.2), draws: int = 8, seed: int = 0) -> dict:
    """``{eps: (mean rise, sd over draws)}`` and the unperturbed loss under key ``"base"``.
    The model's weights are restored afterwards."""
    base = mean_loss(model, batches)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"base": base}
    try:
        dirs = [filter_normalized_direction(model, torch.Generator().manual_seed(seed * 1000 + i))
                for i in range(draws)]
        for eps in sizes:
            rises = []
            for d in dirs:
                for n, p in model.named_parameters():
                    p.copy_(saved[n] + eps * d[n])
                rises.append(mean_loss(model, batches) - base)
            m = sum(rises) / len(rises)
            sd = math.sqrt(sum((r - m) ** 2 for r in rises) / (len(rises) - 1)) if len(rises) > 1 else float("nan")
            out[eps] = (m, sd)
    finally:
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return out


def measure_run(run_dir: Path, *, sizes, draws: int, batches: int, batch_size: int = 500) -> dict:
    """Load a finished run's reference (final.pt) and its config; measure on ``batches``
    training batches (the first examples of the run's training set)."""
    from .config import _build, Config
    from .data import hold_out, load_dataset, to_input
    from .models import build_model
    s = json.loads((run_dir / "summary.json").read_text())
    cfg = _build(Config, s["config"], "")
    if cfg.model.target or cfg.data.target or cfg.train.loss != "cross_entropy":
        raise ValueError(f"{run_dir}: flatness measures the built-in models and datasets with cross-entropy; this run "
                         f"has model.target/data.target/train.loss of its own")
    ds = load_dataset(cfg.data.name, cfg.data.dir, cfg.data.train_limit, cfg.data.test_limit, cfg=cfg.data,
                      seed=cfg.train.seed)
    if cfg.data.val_frac:
        ds = hold_out(ds, cfg.data.val_frac, seed=cfg.train.seed)
    dtype = getattr(torch, cfg.model.dtype)
    model = build_model(cfg.model.name, num_classes=ds.num_classes, in_channels=ds.shape[0], image_size=ds.shape[1],
                        dropout=cfg.model.dropout, depth=cfg.model.depth, width=cfg.model.width).to(dtype=dtype)
    model.load_state_dict(torch.load(run_dir / "final.pt", map_location="cpu"))
    bs = [(to_input(ds.train_x[i:i + batch_size], ds.mean, ds.std, dtype), ds.train_y[i:i + batch_size])
          for i in range(0, min(len(ds.train_x), batches * batch_size), batch_size)]
    r = loss_rise(model, bs, sizes=sizes, draws=draws, seed=cfg.train.seed)
    return {"run": str(run_dir), "algo": s["algo"], "seed": cfg.train.seed, "base_loss": r["base"],
            "rise": {str(e): r[e][0] for e in sizes}, "rise_sd": {str(e): r[e][1] for e in sizes},
            "final_replica_distance": s.get("final_replica_distance")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parle_hvd.flatness", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--sizes", default="0.05,0.1,0.2")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--batches", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        sizes = tuple(float(x) for x in a.sizes.split(","))
    except ValueError:
        print(f"error: --sizes: expected numbers separated by commas, got {a.sizes!r}", file=sys.stderr)
        return 2
    for r in a.runs:
        d = Path(r)
        if not (d / "final.pt").is_file() or not (d / "summary.json").is_file():
            print(f"error: {d}: not a finished run (no final.pt and summary.json)", file=sys.stderr)
            return 2
        try:
            print(json.dumps(measure_run(d, sizes=sizes, draws=a.draws, batches=a.batches)), flush=True)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
