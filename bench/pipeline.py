"""Input pipeline: augmented CIFAR-shaped batches per second, our whole-batch tensor
pipeline vs a per-image DataLoader pipeline, both on one core, in the same run.

The per-image side is what torchvision's ``DataLoader`` + ``transforms.Compose([RandomCrop(32,
padding=4), RandomHorizontalFlip(), ToTensor(), Normalize(...)])`` does, written with PIL and
numpy: torchvision itself cannot be installed beside the CPU torch build (requirements.txt).

    python -m bench.pipeline [--quick]
    target: pipeline_speedup >= 5
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from PIL import Image, ImageOps

from bench.common import emit
from parle_hvd.data import augment_batch, to_input

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class PerImage(torch.utils.data.Dataset):
    """torchvision-style: a PIL image per item, transformed one at a time."""

    def __init__(self, x_u8: np.ndarray, y: np.ndarray):
        self.imgs = [Image.fromarray(a.transpose(1, 2, 0)) for a in x_u8]
        self.y = y
        self.mean = np.array(MEAN, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.array(STD, dtype=np.float32).reshape(3, 1, 1)

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        im = ImageOps.expand(self.imgs[i], border=4, fill=0)             # RandomCrop(32, padding=4)
        dx, dy = random.randint(0, 8), random.randint(0, 8)
        im = im.crop((dx, dy, dx + 32, dy + 32))
        if random.random() < 0.5:                                         # RandomHorizontalFlip
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255.0   # ToTensor
        return torch.from_numpy((a - self.mean) / self.std), int(self.y[i])   # Normalize


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    n, bs = (5120, 128) if a.quick else (20480, 128)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def ours() -> float:
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(n, generator=g)
        t = time.perf_counter()
        for i in range(n // bs):
            b = perm[i * bs:(i + 1) * bs]
            to_input(augment_batch(xt[b], g), MEAN, STD)
            _ = yt[b]
        return (n // bs) / (time.perf_counter() - t)

    ds = PerImage(x, y)

    def theirs() -> float:
        dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=0, drop_last=True)
        t = time.perf_counter()
        for xb, yb in dl:
            pass
        return (n // bs) / (time.perf_counter() - t)

    ours(), theirs()
    o = max(ours() for _ in range(3))
    t = max(theirs() for _ in range(2 if a.quick else 3))
    emit("pipeline_ours_batches_per_sec", o)
    emit("pipeline_dataloader_batches_per_sec", t)
    emit("pipeline_speedup", o / t)
    emit("pipeline_target_met", int(o / t >= 5))


if __name__ == "__main__":
    main()
