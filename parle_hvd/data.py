"""Datasets read from local files, held in memory as uint8 tensors, and the per-replica
sampler.

No torchvision (its PyPI wheels do not import beside the CPU torch build, see
requirements.txt) and no downloads (cluster nodes are often offline): each reader parses
the dataset's standard on-disk format and fails with one line naming the directory, the
files it expected and where to get them.

Order of examples, fully determined by ``(seed, rank, pass)`` so that resuming needs no
RNG state: the replica's window (``split=frac``) is cut after ONE shared shuffle seeded by
``seed``; pass ``e`` of replica ``a`` visits its window in the order
``randperm(len, seed=hash(seed, a, e))``, in ``nb = len // batch`` full batches.
"""
from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch


class DataError(ValueError):
    """Missing or malformed dataset files; one line, names the directory and the files."""


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor       # uint8 [N, C, H, W]
    train_y: torch.Tensor       # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple                 # per-channel, on the 0..1 scale
    std: tuple

    @property
    def shape(self):
        return tuple(self.train_x.shape[1:])


# --------------------------------------------------------------------------- IDX (MNIST-style)
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (gzipped or not): magic 0x0000TTDD, DD big-endian uint32 dims, data."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dt = np.dtype(_IDX_TYPES[raw[2]])
    need = int(np.prod(dims)) * dt.itemsize
    body = raw[4 + 4 * ndim:]
    if len(body) != need:
        raise DataError(f"{path}: truncated or corrupt IDX file (expected {need} data bytes "
                        f"for shape {dims}, found {len(body)})")
    return np.frombuffer(body, dtype=dt).reshape(dims)


def _find(d: Path, stem: str) -> Optional[Path]:
    for cand in (stem, stem + ".gz"):
        if (d / cand).is_file():
            return d / cand
    # some mirrors use dots: train-images.idx3-ubyte
    alt = stem.replace("-idx", ".idx")
    for cand in (alt, alt + ".gz"):
        if (d / cand).is_file():
            return d / cand
    return None


_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

_SOURCES = {
    "fashion-mnist": ("/usr/share/datasets/fashion-mnist",
                      "apt-get install dataset-fashion-mnist, or "
                      "https://github.com/zalandoresearch/fashion-mnist (data/fashion)"),
    "mnist": ("data/mnist", "https://yann.lecun.com/exdb/mnist/ (or any mirror of the four IDX files)"),
}
_STATS = {"fashion-mnist": ((0.2860,), (0.3530,)), "mnist": ((0.1307,), (0.3081,))}


def load_idx_dataset(name: str, directory: str = "") -> Dataset:
    default, where = _SOURCES[name]
    d = Path(directory or default)
    expected = ", ".join(f"{f}[.gz]" for f in _IDX_FILES)
    if not d.is_dir():
        raise DataError(f"{name}: directory {d} does not exist; expected {expected} there "
                        f"(get them: {where}; or set data.dir)")
    paths = [_find(d, f) for f in _IDX_FILES]
    missing = [f for f, p in zip(_IDX_FILES, paths) if p is None]
    if missing:
        raise DataError(f"{name}: {d} lacks {', '.join(missing)}[.gz] (get them: {where})")
    xtr, ytr, xte, yte = (read_idx(p) for p in paths)
    for x, y, px, py in ((xtr, ytr, paths[0], paths[1]), (xte, yte, paths[2], paths[3])):
        if x.ndim != 3 or y.ndim != 1 or x.dtype != np.uint8 or y.dtype != np.uint8:
            raise DataError(f"{name}: {px.name}/{py.name} are not uint8 images [N,H,W] and labels [N]")
        if len(x) != len(y):
            raise DataError(f"{name}: {px.name} has {len(x)} images but {py.name} {len(y)} labels")
        if len(y) and int(y.max()) > 9:
            raise DataError(f"{name}: {py.name} holds label {int(y.max())} (> 9): corrupt file")
    t = lambda a: torch.from_numpy(a.copy())
    mean, std = _STATS[name]
    return Dataset(name, t(xtr).unsqueeze(1), t(ytr).long(), t(xte).unsqueeze(1), t(yte).long(),
                   10, mean, std)


LOADERS = {"fashion-mnist": lambda d: load_idx_dataset("fashion-mnist", d),
           "mnist": lambda d: load_idx_dataset("mnist", d)}


def load_dataset(name: str, directory: str = "", train_limit: int = 0, test_limit: int = 0) -> Dataset:
    if name not in LOADERS:
        raise DataError(f"data.name: unknown dataset {name!r} (known: {', '.join(LOADERS)})")
    ds = LOADERS[name](directory)
    if train_limit:
        ds.train_x, ds.train_y = ds.train_x[:train_limit], ds.train_y[:train_limit]
    if test_limit:
        ds.test_x, ds.test_y = ds.test_x[:test_limit], ds.test_y[:test_limit]
    return ds


# --------------------------------------------------------------------------- per-replica order
def _gen(*keys: int) -> torch.Generator:
    g = torch.Generator()
    h = 0x9E3779B97F4A7C15
    for k in keys:   # a fixed mix of the keys; stable across runs and platforms
        h = (h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    g.manual_seed(h & 0x7FFFFFFFFFFFFFFF)
    return g


def replica_indices(n_train: int, *, rank: int, world: int, split: str, frac: float,
                    seed: int) -> torch.Tensor:
    """The training examples replica ``rank`` sees (PARLE.md "Data split")."""
    if split == "full":
        return torch.arange(n_train)
    perm = torch.randperm(n_train, generator=_gen(seed, 0xDA7A))
    size = max(1, int(round(frac * n_train)))
    start = (rank * n_train) // world
    return perm[(start + torch.arange(size)) % n_train]


class ReplicaSampler:
    """Endless stream of mini-batch index tensors over one replica's examples.

    ``nb`` full batches per pass (the last partial batch is dropped, so every batch, and
    every BatchNorm estimate, has the same size). State is ``(pass, position)``."""

    def __init__(self, indices: torch.Tensor, batch_size: int, *, seed: int, rank: int):
        if batch_size > len(indices):
            raise DataError(f"train.batch_size {batch_size} is larger than a replica's data "
                            f"({len(indices)} examples)")
        self.indices = indices
        self.batch_size = batch_size
        self.seed, self.rank = seed, rank
        self.nb = len(indices) // batch_size
        self.epoch, self.pos = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> torch.Tensor:
        return self.indices[torch.randperm(len(self.indices), generator=_gen(self.seed, self.rank, epoch))]

    def next(self) -> torch.Tensor:
        if self.pos >= self.nb:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        b = self._order[self.pos * self.batch_size:(self.pos + 1) * self.batch_size]
        self.pos += 1
        return b

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
        self._order = self._perm(self.epoch)


def to_input(x_u8: torch.Tensor, mean, std, dtype=torch.float32) -> torch.Tensor:
    """uint8 [B,C,H,W] -> normalised float, on the whole batch at once."""
    x = x_u8.to(dtype).div_(255.0)
    m = torch.tensor(mean, dtype=dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=dtype, device=x.device).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def augment_batch(x_u8: torch.Tensor, g: torch.Generator, pad: int = 4, flip: bool = True) -> torch.Tensor:
    """Random ``pad``-pixel pad-and-crop and horizontal flip, on a whole uint8 batch."""
    b, c, h, w = x_u8.shape
    padded = torch.nn.functional.pad(x_u8, (pad, pad, pad, pad))
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    rows = (dy.view(b, 1) + torch.arange(h).view(1, h))           # [B,H]
    cols = (dx.view(b, 1) + torch.arange(w).view(1, w))           # [B,W]
    out = padded[torch.arange(b).view(b, 1, 1, 1), torch.arange(c).view(1, c, 1, 1),
                 rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]
    if flip:
        f = torch.rand(b, generator=g) < 0.5
        out[f] = out[f].flip(-1)
    return out
