"""A user's dataset, named by file path (data.target=tests/user_code/data.py:make): four classes
in 8 dimensions, the class of x being argmax(W x) for a fixed W, so a small MLP learns it."""
import os

import torch
from torch.utils.data import Dataset, TensorDataset


class Pairs(Dataset):
    """A map-style Dataset that is not a TensorDataset (read item by item)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _draw(n, g, w):
    x = torch.randn(n, 8, generator=g)
    return x, (x @ w.T).argmax(1)


def make(n_train: int = 2048, n_test: int = 512, n_val: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 8, generator=g)
    tr, te, va = _draw(n_train, g, w), _draw(n_test, g, w), _draw(n_val, g, w)
    return TensorDataset(*tr), Pairs(*te), TensorDataset(*va)


def empty():
    x = torch.zeros(0, 8)
    return TensorDataset(x, x[:, 0].long()), TensorDataset(x, x[:, 0].long())


def one_set():
    return TensorDataset(torch.zeros(4, 8), torch.zeros(4).long())


class Jittered(Dataset):
    """A random transform in ``__getitem__`` drawing from the global generators (torch's,
    NumPy's and Python's), as torchvision-style transforms do."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import random
        import numpy as np
        return torch.full((8,), float(i)) + torch.rand(8) + float(np.random.rand()) + random.random(), i % 4


def jittered(n_train: int = 64, n_test: int = 16):
    return Jittered(n_train), Jittered(n_test)


class FailsOnRank1(Dataset):
    """Reads fail on rank 1 only, after its first ``after`` reads (a file only that rank
    reads, gone bad in the middle of a run)."""

    def __init__(self, n, after):
        self.n, self.after, self.reads = n, after, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        if os.environ.get("HOROVOD_RANK", os.environ.get("RANK")) == "1" and self.reads > self.after:
            raise OSError(f"example {i}: Input/output error")
        return torch.full((8,), float(i % 7)), i % 4


def fails_on_rank1(n_train: int = 512, n_test: int = 64, after: int = 400):
    return FailsOnRank1(n_train, after), FailsOnRank1(n_test, 10**9)
