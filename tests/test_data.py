"""Dataset readers on small files in the real on-disk format, written here, and the
per-replica order."""
import gzip
import struct

import numpy as np
import pytest
import torch

from parle_hvd.data import (DataError, ReplicaSampler, augment_batch, load_dataset, read_idx, replica_indices,
                            to_input)


def write_idx(path, arr, gz=False):
    arr = np.asarray(arr, dtype=np.uint8)
    raw = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def make_mnist_dir(d, n_train=50, n_test=20, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    xs = {"train": rng.integers(0, 256, (n_train, 28, 28)), "t10k": rng.integers(0, 256, (n_test, 28, 28))}
    ys = {"train": rng.integers(0, 10, n_train), "t10k": rng.integers(0, 10, n_test)}
    sfx = ".gz" if gz else ""
    for split in ("train", "t10k"):
        write_idx(d / f"{split}-images-idx3-ubyte{sfx}", xs[split], gz)
        write_idx(d / f"{split}-labels-idx1-ubyte{sfx}", ys[split], gz)
    return xs, ys


@pytest.mark.parametrize("gz", [True, False])
def test_idx_dataset_roundtrip(tmp_path, gz):
    xs, ys = make_mnist_dir(tmp_path / "m", gz=gz)
    ds = load_dataset("mnist", str(tmp_path / "m"))
    assert ds.train_x.dtype == torch.uint8 and ds.train_x.shape == (50, 1, 28, 28)
    assert np.array_equal(ds.train_x[:, 0].numpy(), xs["train"]) and np.array_equal(ds.test_y.numpy(), ys["t10k"])
    assert ds.num_classes == 10 and ds.shape == (1, 28, 28)
    lim = load_dataset("mnist", str(tmp_path / "m"), train_limit=10, test_limit=5)
    assert len(lim.train_x) == 10 and len(lim.test_y) == 5


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(DataError, match=r"does not exist; expected train-images-idx3-ubyte"):
        load_dataset("fashion-mnist", str(tmp_path / "nowhere"))
    make_mnist_dir(tmp_path / "m")
    (tmp_path / "m/t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"lacks t10k-labels-idx1-ubyte\[.gz\] \(get them"):
        load_dataset("mnist", str(tmp_path / "m"))


def test_truncated_and_corrupt_files(tmp_path):
    make_mnist_dir(tmp_path / "m", gz=False)
    p = tmp_path / "m/train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated or corrupt IDX"):
        load_dataset("mnist", str(tmp_path / "m"))
    p.write_bytes(b"\x12\x34\x56\x78" + b"\0" * 40)
    with pytest.raises(DataError, match="bad magic"):
        read_idx(p)
    g = tmp_path / "m/x.gz"
    g.write_bytes(gzip.compress(b"\0" * 100)[:20])
    with pytest.raises(DataError, match="cannot read"):
        read_idx(g)


def test_count_mismatch_and_bad_labels(tmp_path):
    make_mnist_dir(tmp_path / "m")
    write_idx(tmp_path / "m/train-labels-idx1-ubyte.gz", np.zeros(49), gz=True)
    with pytest.raises(DataError, match="50 images but"):
        load_dataset("mnist", str(tmp_path / "m"))
    write_idx(tmp_path / "m/train-labels-idx1-ubyte.gz", np.full(50, 12), gz=True)
    with pytest.raises(DataError, match="label 12"):
        load_dataset("mnist", str(tmp_path / "m"))


def test_real_fashion_mnist_if_installed():
    from pathlib import Path
    if not Path("/usr/share/datasets/fashion-mnist").is_dir():
        pytest.skip("dataset-fashion-mnist not installed")
    ds = load_dataset("fashion-mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.test_y).tolist() == [1000] * 10
    x = to_input(ds.train_x[:1000], ds.mean, ds.std)
    assert abs(float(x.mean())) < 0.1 and abs(float(x.std()) - 1) < 0.1


def test_replica_windows_follow_parle_md():
    """frac < 1: one shared shuffle, replica i's window starts at i/n, holds frac, wraps."""
    n_train, n = 12, 3
    wins = [replica_indices(n_train, rank=i, world=n, split="frac", frac=0.5, seed=7) for i in range(n)]
    perm = replica_indices(n_train, rank=0, world=1, split="frac", frac=1.0, seed=7)   # the shared shuffle
    assert sorted(perm.tolist()) == list(range(12))
    for i, w in enumerate(wins):
        assert len(w) == 6
        assert w.tolist() == [perm[(i * 4 + j) % 12].item() for j in range(6)]
    assert wins[2].tolist()[-2:] == perm[:2].tolist()       # wraps around
    assert replica_indices(10, rank=1, world=2, split="full", frac=1.0, seed=0).tolist() == list(range(10))


def test_sampler_determinism_passes_and_resume():
    idx = torch.arange(100, 130)
    s = ReplicaSampler(idx, 8, seed=3, rank=1)
    assert s.nb == 3
    seq = [s.next().tolist() for _ in range(7)]
    ep0 = sum(seq[:3], [])
    assert len(set(ep0)) == 24 and set(ep0) <= set(range(100, 130))      # one pass, no repeats
    assert seq[3:6] != seq[0:3]                                          # a new order each pass
    other = ReplicaSampler(idx, 8, seed=3, rank=0)
    assert other.next().tolist() != seq[0]                               # each replica its own order
    s2 = ReplicaSampler(idx, 8, seed=3, rank=1)
    for _ in range(4):
        s2.next()
    st = s2.state_dict()
    s3 = ReplicaSampler(idx, 8, seed=3, rank=1)
    s3.load_state_dict(st)
    assert [s3.next().tolist() for _ in range(3)] == seq[4:7]
    with pytest.raises(DataError, match="larger than a replica's data"):
        ReplicaSampler(idx, 31, seed=0, rank=0)


def test_augment_batch_is_pad_crop_flip():
    g = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, 3, 8, 8)
    out = augment_batch(x, g, pad=2)
    assert out.shape == x.shape and out.dtype == torch.uint8
    # every output image is a shifted (and maybe flipped) window of the zero-padded input
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        ok = any(torch.equal(out[i], c) or torch.equal(out[i], c.flip(-1))
                 for dy in range(5) for dx in range(5) for c in [padded[i, :, dy:dy + 8, dx:dx + 8]])
        assert ok
