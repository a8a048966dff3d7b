"""Datasets read from local files, held in memory as uint8 tensors, and the per-replica
sampler.

No torchvision (its PyPI wheels do not import beside the CPU torch build, see
requirements.txt) and no downloads (cluster nodes are often offline): each reader parses
the dataset's standard on-disk format and fails with one line naming the directory, the
files it expected and where to get them.

Order of examples, fully determined by ``(seed, rank, pass)`` so that resuming needs no
RNG state: the replica's window (``split=frac``) is cut after ONE shared shuffle seeded by
``seed``; pass ``e`` of replica ``a`` visits its window in the order
``randperm(len, seed=hash("sampler", seed, a, e))``, in ``nb`` full batches, where ``nb``
is the same on every replica (``common_nb``: the smallest window's ``len // batch``).

Windows (``window_bounds``): replica ``i`` of ``n`` starts at ``floor(i*N/n)`` and ends at
``floor(i*N/n + frac*N)`` (wrapping around), so ``frac = 1/n`` cuts the data into ``n``
disjoint shards that cover it (sizes differ by at most one example), which is what
data-parallel SGD uses. A replica id ``a >= n`` (an elastic joiner) takes the window of
``a mod n`` with its own order.

Every random stream is ``_gen(stream, *keys)``: the stream's name is hashed into the first
key, so no counter (a pass, a step) can make two streams coincide.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import struct
import zlib
from fractions import Fraction
import dataclasses
import functools
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
    val_x: Optional[torch.Tensor] = None    # the validation split held out of train_x (data.val_frac)
    val_y: Optional[torch.Tensor] = None

    streamed = False            # held in memory (stream.StreamedData is the streamed kind)

    @property
    def shape(self):
        return tuple(self.train_x.shape[1:])

    @property
    def n_train(self) -> int:
        return len(self.train_x)


# Work done so far by this process while it loads (files listed, headers read, files and
# examples decoded): the watchdog's heartbeat reports it, so that a slow start is told from
# a stuck one.
PROGRESS = [0]


# --------------------------------------------------------------------------- IDX (MNIST-style)
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path, limit: int = 0) -> np.ndarray:
    """Read an IDX file (gzipped or not): magic 0x0000TTDD, DD big-endian uint32 dims, data.

    ``limit`` > 0: only the first ``limit`` items (along the first axis) are decoded, and a
    gzipped file is decompressed only that far (a run with ``data.train_limit=2560`` reads
    2 MB of Fashion-MNIST's 47, 0.3 s less per rank). The file's length is still checked
    against its header, by the gzip trailer's size field; a file whose trailer disagrees is
    read whole, which names the fault. No CRC is checked on such a limited read (gzip's CRC
    covers the whole stream): a flipped bit that still decodes goes unnoticed, as in an
    uncompressed file."""
    return _read_idx(path, limit)[0]


def _read_idx(path: Path, limit: int = 0) -> tuple:
    """``read_idx``, and the number of items the whole file holds (its header's first dim)."""
    try:
        raw = path.read_bytes()
        PROGRESS[0] += 1
        gz = raw[:2] == b"\x1f\x8b"
        if gz and limit > 0:
            head = _idx_prefix(raw, limit)
            if head is not None:
                return head
        if gz:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    dims, dt, start = _idx_header(raw, path)
    need = int(np.prod(dims)) * dt.itemsize
    body = raw[start:]
    if len(body) != need:
        raise DataError(f"{path}: truncated or corrupt IDX file (expected {need} data bytes "
                        f"for shape {dims}, found {len(body)})")
    arr = np.frombuffer(body, dtype=dt).reshape(dims)
    return (arr[:limit] if limit > 0 else arr), dims[0]


def _idx_header(raw: bytes, path: Path):
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    return dims, np.dtype(_IDX_TYPES[raw[2]]), 4 + 4 * ndim


def _idx_prefix(gz: bytes, limit: int) -> Optional[tuple]:
    """The first ``limit`` items of a gzipped IDX file and its item count, decompressing only
    that far; None where the header or the trailer's size (ISIZE: the uncompressed length
    mod 2**32) says the file is not whole, for the full read to report."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    head = d.decompress(gz, 4)
    if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _IDX_TYPES or head[3] == 0:
        return None
    head += d.decompress(d.unconsumed_tail, 4 * head[3])
    if len(head) < 4 + 4 * head[3]:
        return None
    dims = struct.unpack(f">{head[3]}I", head[4:])
    dt = np.dtype(_IDX_TYPES[head[2]])
    whole = len(head) + int(np.prod(dims)) * dt.itemsize
    if len(gz) < 18 or struct.unpack("<I", gz[-4:])[0] != whole % 2 ** 32:
        return None
    n = min(limit, dims[0])
    want = n * int(np.prod(dims[1:])) * dt.itemsize
    body = d.decompress(d.unconsumed_tail, want)
    if len(body) != want:
        return None
    return np.frombuffer(body, dtype=dt).reshape((n, *dims[1:])), dims[0]


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


def load_idx_dataset(name: str, directory: str = "", train_limit: int = 0, test_limit: int = 0) -> Dataset:
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
    # with limits only the examples kept are decoded (and their labels checked); the
    # images and labels files must still hold the same count, from their headers
    lims = (train_limit, train_limit, test_limit, test_limit)
    (xtr, ntr), (ytr, mtr), (xte, nte), (yte, mte) = (_read_idx(p, n) for p, n in zip(paths, lims))
    for x, y, n, m, px, py in ((xtr, ytr, ntr, mtr, paths[0], paths[1]), (xte, yte, nte, mte, paths[2], paths[3])):
        if x.ndim != 3 or y.ndim != 1 or x.dtype != np.uint8 or y.dtype != np.uint8:
            raise DataError(f"{name}: {px.name}/{py.name} are not uint8 images [N,H,W] and labels [N]")
        if n != m:
            raise DataError(f"{name}: {px.name} has {n} images but {py.name} {m} labels")
        if len(y) and int(y.max()) > 9:
            raise DataError(f"{name}: {py.name} holds label {int(y.max())} (> 9): corrupt file")
    t = lambda a: torch.from_numpy(a.copy())
    mean, std = _STATS[name]
    return Dataset(name, t(xtr).unsqueeze(1), t(ytr).long(), t(xte).unsqueeze(1), t(yte).long(),
                   10, mean, std)


# --------------------------------------------------------------------------- CIFAR python pickles
_CIFAR = {
    "cifar10": dict(sub="cifar-10-batches-py", train=[f"data_batch_{i}" for i in range(1, 6)], test=["test_batch"],
                    labels=b"labels", classes=10, url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                    stats=((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))),
    "cifar100": dict(sub="cifar-100-python", train=["train"], test=["test"], labels=b"fine_labels", classes=100,
                     url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                     stats=((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))),
}


def _unpickle(path: Path) -> dict:
    import pickle
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise DataError(f"{path}: truncated or corrupt CIFAR pickle ({e.__class__.__name__})") from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: not a CIFAR batch (expected a dict)")
    PROGRESS[0] += 1
    return d


def load_cifar(name: str, directory: str) -> Dataset:
    spec = _CIFAR[name]
    base = Path(directory or f"data/{spec['sub']}")
    d = base / spec["sub"] if (base / spec["sub"]).is_dir() else base
    expected = ", ".join(spec["train"] + spec["test"])
    if not d.is_dir():
        raise DataError(f"{name}: directory {base} does not exist; expected {expected} "
                        f"(the python version: {spec['url']}, extracted; or set data.dir)")
    missing = [f for f in spec["train"] + spec["test"] if not (d / f).is_file()]
    if missing:
        raise DataError(f"{name}: {d} lacks {', '.join(missing)} (get {spec['url']} and extract it there)")

    def read(files):
        xs, ys = [], []
        for f in files:
            b = _unpickle(d / f)
            if b"data" not in b or spec["labels"] not in b:
                raise DataError(f"{d / f}: not a {name} batch (no data/{spec['labels'].decode()} keys)")
            x = np.asarray(b[b"data"], dtype=np.uint8)
            y = np.asarray(b[spec["labels"]], dtype=np.int64)
            if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
                raise DataError(f"{d / f}: corrupt {name} batch (data {x.shape}, {len(y)} labels)")
            if len(y) and (y.min() < 0 or y.max() >= spec["classes"]):
                raise DataError(f"{d / f}: label {int(y.max())} out of range for {name}")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(y)
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    xtr, ytr = read(spec["train"])
    xte, yte = read(spec["test"])
    return Dataset(name, xtr, ytr, xte, yte, spec["classes"], *spec["stats"])


# --------------------------------------------------------------------------- SVHN .mat
def load_svhn(directory: str, extra: bool = False) -> Dataset:
    import scipy.io
    d = Path(directory or "data/svhn")
    files = ["train_32x32.mat", "test_32x32.mat"] + (["extra_32x32.mat"] if extra else [])
    url = "http://ufldl.stanford.edu/housenumbers/ (format 2: train_32x32.mat, test_32x32.mat, extra_32x32.mat)"
    if not d.is_dir():
        raise DataError(f"svhn: directory {d} does not exist; expected {', '.join(files)} (get them: {url})")
    missing = [f for f in files if not (d / f).is_file()]
    if missing:
        raise DataError(f"svhn: {d} lacks {', '.join(missing)} (get them: {url})")

    def read(f):
        try:
            m = scipy.io.loadmat(str(d / f))
        except Exception as e:  # noqa: BLE001 - scipy raises many types for bad files
            raise DataError(f"{d / f}: truncated or corrupt .mat file ({e.__class__.__name__})") from None
        if "X" not in m or "y" not in m:
            raise DataError(f"{d / f}: not an SVHN file (no X/y arrays)")
        x, y = np.asarray(m["X"]), np.asarray(m["y"]).reshape(-1).astype(np.int64)
        if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != len(y) or x.dtype != np.uint8:
            raise DataError(f"{d / f}: corrupt SVHN arrays (X {x.shape} {x.dtype}, y {y.shape})")
        y[y == 10] = 0                          # SVHN stores the digit 0 as label 10
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise DataError(f"{d / f}: SVHN label out of range")
        return torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1))), torch.from_numpy(y)

    parts = []
    for f in files:
        parts.append(read(f))
        PROGRESS[0] += 1
    xtr = torch.cat([parts[0][0]] + [p[0] for p in parts[2:]])
    ytr = torch.cat([parts[0][1]] + [p[1] for p in parts[2:]])
    return Dataset("svhn", xtr, ytr, parts[1][0], parts[1][1], 10,
                   (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))


# --------------------------------------------------------------------------- image folder
_IMG_EXT = {".png", ".jpg", ".jpeg"}
_GRAY_MODES = ("L", "1", "I", "I;16", "I;16B", "I;16L", "I;16N", "LA")


@functools.lru_cache(maxsize=1)
def _bad_image() -> tuple:
    """What PIL raises for a truncated, corrupt or unreadable image (a bomb is corrupt, too)."""
    from PIL import Image
    return OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError


def _suffix(name: str) -> str:
    i = name.rfind(".")                   # Path.suffix's rule: "..jpg" has one, ".jpg" none
    return name[i:].lower() if 0 < i < len(name) - 1 else ""


def _class_files(d: Path) -> dict:
    """Each class subfolder's image paths, sorted. Strings from ``os.scandir``, not Path
    objects: a million files list in about a second instead of 13 (Path's construction,
    ``suffix`` and comparison dominate); the same strings as ``str(Path)``."""
    out = {}
    with os.scandir(d) as it:
        classes = sorted(e.name for e in it if e.is_dir())
    for name in classes:
        cdir = str(d / name)
        fs = []
        with os.scandir(cdir) as it:
            for e in it:                   # counted as progress: the other ranks see this rank alive
                if _suffix(e.name) in _IMG_EXT:
                    fs.append(f"{cdir}{os.sep}{e.name}")
                PROGRESS[0] += 1
        fs.sort()
        out[name] = fs
    return out


def folder_split(directory: str, test_frac: float = 0.1, seed: int = 0) -> tuple:
    """The file lists of an image folder, without opening an image: ``(classes, train,
    test)``, each list of ``(path, label)`` in class order. ``dir/train/<class>/*`` and
    ``dir/test/<class>/*``, or ``dir/<class>/*`` with ``test_frac`` of each class held out
    (a shuffle fixed by ``seed``, the run's train.seed)."""
    if not directory:
        raise DataError("folder: set data.dir to a directory of class subfolders of PNG/JPEG images")
    d = Path(directory)
    if not d.is_dir():
        raise DataError(f"folder: directory {d} does not exist; expected train/<class>/*.png|jpg and "
                        f"test/<class>/*, or <class>/*.png|jpg")
    if (d / "train").is_dir() and (d / "test").is_dir():
        tr, te = _class_files(d / "train"), _class_files(d / "test")
        classes = sorted(tr)
        if sorted(te) != classes:
            raise DataError(f"folder: {d}/train and {d}/test have different class subfolders")
        split = {c: (tr[c], te[c]) for c in classes}
    else:
        files = _class_files(d)
        classes = sorted(files)
        split = {}
        for c in classes:
            fs = files[c]
            perm = torch.randperm(len(fs), generator=_gen("folder-split", seed, len(fs))).tolist()
            n_te = int(round(test_frac * len(fs))) if len(fs) > 1 else 0
            split[c] = ([fs[i] for i in perm[n_te:]], [fs[i] for i in perm[:n_te]])
    if len(classes) < 2 or any(not split[c][0] for c in classes):
        raise DataError(f"folder: {d} needs at least 2 class subfolders, each with PNG/JPEG training images")
    train = [(str(f), li) for li, c in enumerate(classes) for f in split[c][0]]
    test = [(str(f), li) for li, c in enumerate(classes) for f in split[c][1]]
    if not test:
        raise DataError(f"folder: {d} gives no test images (add test/ or more images per class)")
    return classes, train, test


def open_image(src, name: str = ""):
    """A PIL image from a path or the file's bytes (header only: nothing decoded yet).
    Raises DataError naming the file."""
    from PIL import Image
    import io
    try:
        im = Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray, memoryview)) else src)
        im.size, im.mode          # noqa: B018 - a bad header fails here
        return im
    except _bad_image() as e:
        raise DataError(f"{name or src}: unreadable or corrupt image ({e.__class__.__name__})") from None


def rrc_box(w: int, h: int, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple:
    """RandomResizedCrop's box (left, top, right, bottom) in a w x h image: torchvision's
    algorithm (10 tries at a random area and log-uniform aspect ratio, else the central
    crop at the nearest allowed ratio), drawing from ``rng`` (a ``random.Random``)."""
    import math
    area = w * h
    lr = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ar = math.exp(rng.uniform(*lr))
        cw, ch = int(round(math.sqrt(target * ar))), int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return x0, y0, x0 + cw, y0 + ch
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        cw, ch = int(round(h * ratio[1])), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


def center_box(w: int, h: int, crop_frac: float) -> tuple:
    """The central square of side ``crop_frac`` x the shorter side: resize-shorter-side then
    center-crop (ImageNet's 256 -> 224 is crop_frac 0.875) as one crop of the original."""
    s = min(w, h) * crop_frac
    x0, y0 = round((w - s) / 2), round((h - s) / 2)      # whole-pixel offsets, as torchvision's CenterCrop
    return x0, y0, x0 + s, y0 + s


def decode_image(src, *, size: int, gray: bool, recipe: str = "fixed", rng=None, crop_frac: float = 0.875,
                 name: str = "") -> np.ndarray:
    """One image (a path or its bytes) -> uint8 [C, size, size], resized as it is decoded
    (a JPEG is decoded at the smallest 1/2^k scale that still covers the output, and no
    full-size copy is kept). ``recipe``:

    * ``fixed``: the whole image squashed to size x size (what the in-memory folder holds);
    * ``train``: RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + horizontal flip, drawn
      from ``rng`` (a ``random.Random``);
    * ``eval``: resize the shorter side to size / crop_frac, then the central size x size.

    Any mode (palette, RGBA, CMYK, 16-bit, grayscale) becomes L (``gray``) or RGB.
    Raises DataError naming the file when it cannot be decoded."""
    from PIL import Image
    mode = "L" if gray else "RGB"
    im = open_image(src, name)
    try:
        with im:
            w, h = im.size
            if recipe == "fixed":
                box = (0, 0, w, h)
            elif recipe == "train":
                box = rrc_box(w, h, rng)
            elif recipe == "eval":
                box = center_box(w, h, crop_frac)
            else:
                raise ValueError(f"decode_image: unknown recipe {recipe!r}")
            bw, bh = box[2] - box[0], box[3] - box[1]
            if im.format == "JPEG" and min(bw, bh) >= 2 * size:
                # decode at a reduced scale: the crop still covers size x size pixels
                im.draft(mode, (max(size, int(w * size / bw)), max(size, int(h * size / bh))))
                sx, sy = im.size[0] / w, im.size[1] / h
                box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            if im.mode.startswith("I;16"):
                # 16-bit pixels (a PNG or TIFF): PIL's convert clips them at 255, which turns
                # the image nearly white; their top byte instead (mode I, 32-bit integers of
                # no known range, is left to PIL)
                px = np.asarray(im).astype(np.int64) >> 8
                im = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))
            im = im.convert(mode) if im.mode != mode else im
            if recipe == "fixed" and im.size == (size, size):
                out = im
            else:
                out = im.resize((size, size), Image.BILINEAR, box=box if recipe != "fixed" else None)
            if recipe == "train" and rng.random() < 0.5:
                out = out.transpose(Image.FLIP_LEFT_RIGHT)
            a = np.array(out, dtype=np.uint8)      # a copy: writable, and no reference to PIL's buffer
    except _bad_image() as e:
        raise DataError(f"{name or src}: unreadable or corrupt image ({e.__class__.__name__})") from None
    return a[None] if gray else a.transpose(2, 0, 1)


def is_gray(srcs, skip_corrupt: bool = False) -> bool:
    """Every image's mode (read from its header) is a grayscale one (``skip_corrupt``: an
    unreadable one does not count; else it raises DataError naming it). ``srcs``: paths,
    or ``(bytes, name)`` pairs (a shard's member)."""
    out = True
    for s in srcs:
        src, name = s if isinstance(s, tuple) else (s, "")
        try:
            with open_image(src, name) as im:
                out = out and im.mode in _GRAY_MODES
        except DataError:
            if not skip_corrupt:
                raise
        PROGRESS[0] += 1
    return out


class PixelStats:
    """Per-channel mean and std on the 0..1 scale, from exact integer sums of uint8 pixels:
    the same numbers whatever the batching or order (in memory or streamed)."""

    def __init__(self):
        self.n, self.s, self.ss = 0, None, None

    def add(self, x_u8: torch.Tensor) -> None:
        v = x_u8.to(torch.int64).transpose(0, 1).reshape(x_u8.shape[1], -1)
        s, ss = v.sum(1), (v * v).sum(1)
        self.s = s if self.s is None else self.s + s
        self.ss = ss if self.ss is None else self.ss + ss
        self.n += v.shape[1]

    def result(self) -> tuple:
        mean, std = [], []
        for s, ss in zip(self.s.tolist(), self.ss.tolist()):
            n = self.n
            mean.append(s / n / 255.0)
            var = (ss - Fraction(s * s, n)) / max(n - 1, 1) / (255 * 255)
            std.append(max(float(var) ** 0.5, 1e-3))
        return tuple(mean), tuple(std)


def load_folder(directory: str, image_size: int = 0, test_frac: float = 0.1, seed: int = 0) -> Dataset:
    """Class subfolders of PNG/JPEG images, decoded into memory at ``image_size`` (0: the
    first image's width), one image at a time (folder_split gives the layout)."""
    classes, train, test = folder_split(directory, test_frac, seed)
    gray = is_gray(f for f, _ in train + test)
    if image_size:
        size = image_size
    else:
        with open_image(train[0][0]) as im:
            size = im.size[0]
    c_ = 1 if gray else 3

    def read(files):
        x = torch.empty(len(files), c_, size, size, dtype=torch.uint8)
        for i, (f, _) in enumerate(files):
            x[i] = torch.from_numpy(decode_image(f, size=size, gray=gray))
            PROGRESS[0] += 1
        return x, torch.tensor([y for _, y in files], dtype=torch.int64)

    xtr, ytr = read(train)
    xte, yte = read(test)
    st = PixelStats()
    for i in range(0, len(xtr), 4096):
        st.add(xtr[i:i + 4096])
    return Dataset("folder", xtr, ytr, xte, yte, len(classes), *st.result())


# Each loader: (data config, seed, (train_limit, test_limit)). The IDX readers stop at the
# limits; the others read everything and load_dataset cuts.
LOADERS = {"fashion-mnist": lambda c, seed, lim: load_idx_dataset("fashion-mnist", c.dir, *lim),
           "mnist": lambda c, seed, lim: load_idx_dataset("mnist", c.dir, *lim),
           "cifar10": lambda c, seed, lim: load_cifar("cifar10", c.dir),
           "cifar100": lambda c, seed, lim: load_cifar("cifar100", c.dir),
           "svhn": lambda c, seed, lim: load_svhn(c.dir, c.svhn_extra),
           "folder": lambda c, seed, lim: load_folder(c.dir, c.image_size, c.test_frac, seed)}


def load_dataset(name: str, directory: str = "", train_limit: int = 0, test_limit: int = 0, *,
                 cfg=None, seed: int = 0) -> Dataset:
    """``cfg`` (a DataConfig) supplies the dataset-specific keys; name/directory otherwise.
    ``seed`` (the run's train.seed) fixes any split the loader makes itself (folder).
    The limits keep the first examples of each split."""
    if name not in LOADERS:
        raise DataError(f"data.name: unknown dataset {name!r} (known: {', '.join(LOADERS)})")
    if cfg is None:
        from types import SimpleNamespace
        cfg = SimpleNamespace(dir=directory, svhn_extra=False, image_size=0, test_frac=0.1)
    ds = LOADERS[name](cfg, seed, (train_limit, test_limit))
    if train_limit:
        ds.train_x, ds.train_y = ds.train_x[:train_limit], ds.train_y[:train_limit]
    if test_limit:
        ds.test_x, ds.test_y = ds.test_x[:test_limit], ds.test_y[:test_limit]
    return ds


def hold_out(ds: Dataset, frac: float, *, seed: int) -> Dataset:
    """Hold out ``frac`` of each class of the training set as the validation split
    (stratified; the examples fixed by ``seed``); the rest stays the training set. Anything
    selected (a step, a learning rate, a variant) is selected on it, never on the test set."""
    val, keep = [], []
    for c in torch.unique(ds.train_y).tolist():
        idx = (ds.train_y == c).nonzero(as_tuple=True)[0]
        idx = idx[torch.randperm(len(idx), generator=_gen("val-split", seed, c))]
        n_val = int(round(frac * len(idx)))
        val.append(idx[:n_val])
        keep.append(idx[n_val:])
    val_i, keep_i = torch.cat(val).sort().values, torch.cat(keep).sort().values
    if len(val_i) == 0 or len(keep_i) == 0:
        raise DataError(f"data.val_frac {frac}: leaves an empty validation or training set "
                        f"({len(ds.train_y)} training examples)")
    return Dataset(ds.name, ds.train_x[keep_i], ds.train_y[keep_i], ds.test_x, ds.test_y, ds.num_classes,
                   ds.mean, ds.std, ds.train_x[val_i], ds.train_y[val_i])


# --------------------------------------------------------------------------- per-replica order
def _stream_tag(stream: str) -> int:
    return int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")


def _gen(stream: str, *keys: int, device=None) -> torch.Generator:
    """A generator for the named ``stream`` ("sampler", "augment", "bn", "window", ...),
    seeded by a fixed mix of the stream's tag and the keys; stable across runs and platforms.
    The tag comes first and no two streams share one, so a counter cannot reach another stream.
    ``device``: a generator that draws on that device (a GPU's draws differ from the CPU's)."""
    if not isinstance(stream, str):
        raise TypeError("_gen: the first argument names the stream")
    g = torch.Generator() if device is None or torch.device(device).type == "cpu" else torch.Generator(device=device)
    g.manual_seed(seed_of(stream, *keys))
    return g


def seed_of(stream: str, *keys: int) -> int:
    """The 63-bit seed ``_gen`` gives the named stream and keys (also for a worker's
    per-example ``random.Random``: streamed augmentation, stream.py)."""
    h = 0x9E3779B97F4A7C15
    for k in (_stream_tag(stream), *keys):
        h = (h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def window_bounds(n_train: int, world: int, frac: float) -> list[tuple[int, int]]:
    """``(start, size)`` of every replica's window: replica ``i`` covers positions
    ``[floor(i*N/n), floor(i*N/n + frac*N))`` of the shared shuffle (mod N). Exact rational
    arithmetic, so ``frac = 1/n`` gives disjoint shards covering the data."""
    f = Fraction(frac).limit_denominator(1_000_000)
    out = []
    for i in range(world):
        start = (i * n_train) // world
        end = (Fraction(i * n_train, world) + f * n_train).__floor__()
        out.append((start, max(1, min(n_train, end - start))))
    return out


def replica_indices(n_train: int, *, rank: int, world: int, split: str, frac: float,
                    seed: int) -> torch.Tensor:
    """The training examples replica ``rank`` sees (PARLE.md "Data split"); a replica id
    beyond the world (an elastic joiner) takes the window of ``rank % world``."""
    if split == "full":
        return torch.arange(n_train)
    perm = torch.randperm(n_train, generator=_gen("window", seed))
    start, size = window_bounds(n_train, world, frac)[rank % world]
    return perm[(start + torch.arange(size)) % n_train]


def common_nb(n_train: int, *, world: int, split: str, frac: float, batch_size: int) -> int:
    """Batches per pass, the same on every replica (else their step counts, and the
    collectives, would differ): the smallest window's full batches."""
    if split == "full":
        return n_train // batch_size
    return min(size for _, size in window_bounds(n_train, world, frac)) // batch_size


class ReplicaSampler:
    """Endless stream of mini-batch index tensors over one replica's examples.

    ``nb`` full batches per pass (the last partial batch is dropped, so every batch, and
    every BatchNorm estimate, has the same size; ``nb`` may be given, the same on every
    replica, when windows differ in size by one example). Each pass reshuffles the whole
    window, so an example left out of one pass is seen in others. State is ``(pass, position)``."""

    def __init__(self, indices: torch.Tensor, batch_size: int, *, seed: int, rank: int,
                 nb: Optional[int] = None, device=None):
        if batch_size > len(indices) or nb == 0:
            raise DataError(f"train.batch_size {batch_size} is larger than a replica's data "
                            f"({len(indices)} examples)")
        self.indices = indices
        self.batch_size = batch_size
        self.seed, self.rank = seed, rank
        self.device = device         # where the batches' indices live: the data's device (one copy per pass)
        self.nb = len(indices) // batch_size if nb is None else min(nb, len(indices) // batch_size)
        self.epoch, self.pos = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> torch.Tensor:
        order = self.indices[torch.randperm(len(self.indices), generator=_gen("sampler", self.seed, self.rank, epoch))]
        return order if self.device is None else order.to(self.device)

    def next(self) -> torch.Tensor:
        if self.pos >= self.nb:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._perm(self.epoch)
        b = self._order[self.pos * self.batch_size:(self.pos + 1) * self.batch_size]
        self.pos += 1
        return b

    def advance(self) -> None:
        """Count one batch as taken without computing it (a streamed feed: its DataLoader
        took the batch from ``batches_from``; this keeps the position a checkpoint saves)."""
        if self.pos >= self.nb:
            self.epoch, self.pos = self.epoch + 1, 0
        self.pos += 1

    def batches_from(self, epoch: int, pos: int):
        """The endless stream of ``(epoch, pos, indices)`` from position ``(epoch, pos)``,
        the batches ``next()`` would give from there, without touching this sampler."""
        while True:
            if pos >= self.nb:
                epoch, pos = epoch + 1, 0
            order = self.indices[torch.randperm(len(self.indices), generator=_gen("sampler", self.seed, self.rank, epoch))]
            while pos < self.nb:
                yield epoch, pos, order[pos * self.batch_size:(pos + 1) * self.batch_size]
                pos += 1

    def __len__(self) -> int:
        return self.nb

    def __iter__(self):
        """One pass's batches as index lists, from where the stream stands: a torch
        ``DataLoader(dataset, batch_sampler=sampler)`` then gives this replica's batches
        (examples/own_loop.py), in the order the trainer takes them."""
        for _ in range(self.nb - self.pos if self.pos < self.nb else self.nb):
            yield self.next().tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])
        self._order = self._perm(self.epoch)


def to_device(ds: Dataset, device) -> Dataset:
    """``ds`` with every tensor on ``device``, copied once (a GPU rank then indexes and
    augments its batches there: no host-to-device copy per batch). ``ds`` itself if it is
    there already."""
    device = torch.device(device)
    if ds.train_x.device == device:
        return ds
    mv = lambda t: None if t is None else t.to(device)
    return dataclasses.replace(ds, train_x=mv(ds.train_x), train_y=mv(ds.train_y), test_x=mv(ds.test_x),
                               test_y=mv(ds.test_y), val_x=mv(ds.val_x), val_y=mv(ds.val_y))


@functools.lru_cache(maxsize=32)
def _norm_constants(mean: tuple, std: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=dtype, device=device).view(1, -1, 1, 1)
    shift = torch.tensor([m / s for m, s in zip(mean, std)], dtype=dtype, device=device).view(1, -1, 1, 1)
    return scale, shift


def to_input(x_u8: torch.Tensor, mean, std, dtype=torch.float32) -> torch.Tensor:
    """uint8 [B,C,H,W] -> normalised float ``(x/255 - mean)/std``, on the whole batch, in
    two passes (one multiply-subtract per channel); the constants are made once per device.
    Without statistics (a ``data.target`` dataset, targets.py) the input goes in as it is:
    floating inputs cast to ``dtype``, integer ones (token ids) unchanged."""
    if mean is None:
        return x_u8.to(dtype) if x_u8.is_floating_point() else x_u8
    scale, shift = _norm_constants(tuple(mean), tuple(std), dtype, x_u8.device)
    return x_u8.to(dtype).mul_(scale).sub_(shift)


def augment_batch(x_u8: torch.Tensor, g: torch.Generator, pad: int = 4, flip: bool = True) -> torch.Tensor:
    """Random ``pad``-pixel pad-and-crop and horizontal flip of a whole uint8 batch, as one
    gather: each output pixel's source index in the zero-padded image is computed for the
    whole batch (crop offset, and mirrored columns for the flipped images)."""
    b, c, h, w = x_u8.shape
    H, W = h + 2 * pad, w + 2 * pad
    padded = torch.nn.functional.pad(x_u8, (pad, pad, pad, pad)).view(b, c, H * W)
    dev = g.device                       # the draws are made where the generator lives
    dx = torch.randint(0, 2 * pad + 1, (b, 1), generator=g, device=dev)
    dy = torch.randint(0, 2 * pad + 1, (b, 1), generator=g, device=dev)
    j = torch.arange(w, device=dev).view(1, w)
    if flip:
        flipped = torch.rand(b, 1, generator=g, device=dev) < 0.5
        j = torch.where(flipped, w - 1 - j, j)
    cols = dx + j                                                  # [B, W]
    rows = dy + torch.arange(h, device=dev).view(1, h)             # [B, H]
    idx = (rows.view(b, h, 1) * W + cols.view(b, 1, w)).view(b, 1, h * w).expand(b, c, h * w)
    return torch.gather(padded, 2, idx.to(x_u8.device)).view(b, c, h, w)   # no copy when g is on x's device
