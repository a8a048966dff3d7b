"""WebDataset-style tar shards: ``<key>.jpg`` (or ``.png``) + ``<key>.cls`` per example.

    python -m parle_hvd.shards write IMAGE_FOLDER OUT_DIR [--per-shard 1000] [--seed 42]
    python train.py --config ... data.name=shards data.dir=OUT_DIR data.workers=4

``write`` reads an image folder (``train/<class>/*`` and ``test/<class>/*``, or
``<class>/*`` with ``--test-frac`` held out exactly as ``data.name=folder`` holds it out
at ``train.seed = --seed``), shuffles each split once (``--seed``: every shard mixes the
classes) and writes ``OUT_DIR/{train,test}/shard-NNNNNN.tar``. The image bytes are copied,
not re-encoded, so a shard decodes to the same pixels as the folder. Beside each shard an
index ``shard-NNNNNN.idx.json`` (key, offset and size of each image, label) lets a rank
start without scanning the tars; ``OUT_DIR/classes.json`` names the labels. Shards
written by other tools (webdataset's ShardWriter, tarp) read as well: without an index a
shard's headers are scanned once at start. (Read with ``tarfile``, not the webdataset
package, whose worker-split pipeline cannot resume mid-pass: docs/algorithm.md.)

Reading (stream.py): a shard is read whole and in order (one sequential read: what a
cluster file system serves best); each replica visits its shards in its own order per
pass and mixes the examples of ``data.shuffle_shards`` shards at a time.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

import torch

from . import data as D
from .data import DataError, _IMG_EXT, _gen, folder_split

_EXT = tuple(sorted(_IMG_EXT))


def shard_index(path: Path) -> list:
    """``[(key, offset, size, label), ...]`` of one shard's examples, in file order: from its
    ``.idx.json`` when there is one, else by scanning the tar's headers once."""
    side = path.with_name(path.name[:-4] + ".idx.json")
    if side.is_file():
        try:
            rows = [tuple(r) for r in json.loads(side.read_text())["examples"]]
            D.PROGRESS[0] += len(rows)
            return rows
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{side}: unreadable shard index ({type(e).__name__}); delete it to rescan the shard") from None
    imgs, cls = {}, {}
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                D.PROGRESS[0] += 1
                if not m.isfile():
                    continue
                key, dot, ext = m.name.rpartition(".")
                if not dot:
                    continue
                if "." + ext.lower() in _IMG_EXT:
                    imgs[key] = (m.offset_data, m.size)
                elif ext == "cls":
                    cls[key] = int(tf.extractfile(m).read().decode().strip())
    except (OSError, tarfile.TarError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable or corrupt tar shard ({type(e).__name__}: {e})") from None
    missing = [k for k in imgs if k not in cls]
    if missing:
        raise DataError(f"{path}: example {missing[0]!r} has an image but no {missing[0]}.cls label")
    return [(k, off, size, cls[k]) for k, (off, size) in sorted(imgs.items(), key=lambda kv: kv[1][0])]


def shard_files(d: Path) -> list:
    return sorted(p for p in d.glob("*.tar") if p.is_file())


def read_shards(directory: str) -> tuple:
    """``(classes, train, test)``; train and test are ``(shard paths, [(shard no, key, offset,
    size, label), ...])`` in shard order."""
    if not directory:
        raise DataError("shards: set data.dir to a directory with train/*.tar and test/*.tar "
                        "(python -m parle_hvd.shards write IMAGE_FOLDER DIR makes one)")
    d = Path(directory)
    if not (d / "train").is_dir() or not (d / "test").is_dir():
        raise DataError(f"shards: {d} needs train/ and test/ folders of .tar shards "
                        f"(python -m parle_hvd.shards write IMAGE_FOLDER {d} makes them)")
    out = []
    for part in ("train", "test"):
        files = shard_files(d / part)
        if not files:
            raise DataError(f"shards: {d / part} has no .tar shards")
        rows = [(s, *r) for s, f in enumerate(files) for r in shard_index(f)]
        if not rows:
            raise DataError(f"shards: the shards in {d / part} hold no <key>.jpg/.png + <key>.cls examples")
        out.append(([str(f) for f in files], rows))
    labels = {r[4] for part in out for r in part[1]}
    if (d / "classes.json").is_file():
        try:
            classes = list(json.loads((d / "classes.json").read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"{d / 'classes.json'}: unreadable ({type(e).__name__})") from None
    else:
        classes = [str(i) for i in range(max(labels) + 1)]
    if min(labels) < 0 or max(labels) >= len(classes):
        raise DataError(f"shards: label {max(labels)} in {d} is out of range for {len(classes)} classes")
    return classes, out[0], out[1]


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), 0o644, 0      # mtime 0: the same input writes the same bytes
    start = tf.offset + len(ti.tobuf(tf.format, tf.encoding, tf.errors))   # where the data will begin
    tf.addfile(ti, io.BytesIO(data))
    return start


def write_split(files: list, out: Path, per_shard: int, seed: int, part: str) -> int:
    """Write ``files`` ([(path, label)]) shuffled by ``seed`` as shards of ``per_shard``
    examples into ``out``; returns the number of shards."""
    out.mkdir(parents=True, exist_ok=True)
    order = torch.randperm(len(files), generator=_gen("shard-write", seed, len(files), part == "test")).tolist()
    n = 0
    for n, lo in enumerate(range(0, len(order), per_shard)):
        path = out / f"shard-{n:06d}.tar"
        rows = []
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for j, i in enumerate(order[lo:lo + per_shard]):
                src, label = files[i]
                key = f"{lo + j:09d}"
                data = Path(src).read_bytes()
                ext = Path(src).suffix.lower()
                off = _add(tf, key + ext, data)
                _add(tf, key + ".cls", str(label).encode())
                rows.append([key, off, len(data), label])
        path.with_name(path.name[:-4] + ".idx.json").write_text(json.dumps({"examples": rows}))
    return n + 1


def write(src: str, dst: str, *, per_shard: int = 1000, seed: int = 42, test_frac: float = 0.1) -> dict:
    """An image folder -> tar shards (the module docstring); returns counts."""
    classes, train, test = folder_split(src, test_frac, seed)
    d = Path(dst)
    for part in ("train", "test"):
        if (d / part).is_dir() and shard_files(d / part):
            raise DataError(f"shards: {d / part} already holds shards; write into an empty directory")
    counts = {"classes": len(classes), "train": len(train), "test": len(test),
              "train_shards": write_split(train, d / "train", per_shard, seed, "train"),
              "test_shards": write_split(test, d / "test", per_shard, seed, "test")}
    (d / "classes.json").write_text(json.dumps(classes))
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parle_hvd.shards", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write tar shards from an image folder")
    w.add_argument("src", help="image folder: train/<class>/* and test/<class>/*, or <class>/*")
    w.add_argument("dst", help="output directory (train/ and test/ shards, classes.json)")
    w.add_argument("--per-shard", type=int, default=1000, help="examples per shard (default 1000)")
    w.add_argument("--seed", type=int, default=42, help="the shuffle, and the test split of a <class>/* folder")
    w.add_argument("--test-frac", type=float, default=0.1, help="<class>/* folders: fraction held out for test")
    a = ap.parse_args(argv)
    if a.per_shard < 1 or not 0.0 < a.test_frac < 1.0:
        print("error: --per-shard must be >= 1 and --test-frac in (0, 1)", file=sys.stderr)
        return 2
    try:
        c = write(a.src, a.dst, per_shard=a.per_shard, seed=a.seed, test_frac=a.test_frac)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {c['train']} training examples in {c['train_shards']} shards and {c['test']} test examples "
          f"in {c['test_shards']} shards ({c['classes']} classes) to {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
