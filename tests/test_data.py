"""Dataset readers on small files in the real on-disk format, written here, and the
per-replica order."""
import gzip
import struct

import numpy as np
import pytest
import torch

from parle_hvd.data import (DataError, ReplicaSampler, _gen, augment_batch, common_nb, load_dataset, read_idx,
                            replica_indices, to_input, window_bounds)


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


def test_a_limited_read_decodes_only_the_prefix_and_still_checks_the_whole_file(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (40, 28, 28)).astype(np.uint8)
    raw = struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">3I", 40, 28, 28) + x.tobytes()
    g, plain, multi = tmp_path / "x.gz", tmp_path / "x", tmp_path / "multi.gz"
    g.write_bytes(gzip.compress(raw))
    plain.write_bytes(raw)
    # two gzip members: the trailer's size is the last member's, so the whole file is read
    multi.write_bytes(gzip.compress(raw[:1000]) + gzip.compress(raw[1000:]))
    for f in (g, plain, multi):
        for n in (1, 7, 40, 100):
            got = read_idx(f, n)
            assert got.shape == (min(n, 40), 28, 28) and np.array_equal(got, x[:n]), (f.name, n)
    assert np.array_equal(read_idx(g), x)
    # a file cut short is refused, with or without a limit
    g.write_bytes(gzip.compress(raw)[:-40])
    for n in (0, 5):
        with pytest.raises(DataError, match="cannot read"):
            read_idx(g, n)
    plain.write_bytes(raw[:-100])
    for n in (0, 5):
        with pytest.raises(DataError, match="truncated or corrupt IDX"):
            read_idx(plain, n)
    # a gzip member whose size field disagrees with the IDX header: read whole, then refused
    g.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(DataError, match="truncated or corrupt IDX"):
        read_idx(g, 5)
    # a deflate stream garbled inside the kept part is refused, never returned as data
    g.write_bytes(gzip.compress(raw)[:200] + bytes(range(256)) * 8 + gzip.compress(raw)[200 + 2048:])
    with pytest.raises(DataError, match="cannot read"):
        read_idx(g, 40)


@pytest.mark.skipif(not __import__("pathlib").Path("/usr/share/datasets/fashion-mnist").is_dir(),
                    reason="dataset-fashion-mnist not installed")
def test_limits_on_fashion_mnist_give_the_first_examples_of_the_whole_read():
    whole = load_dataset("fashion-mnist")
    lim = load_dataset("fashion-mnist", train_limit=2560, test_limit=500)
    assert torch.equal(lim.train_x, whole.train_x[:2560]) and torch.equal(lim.train_y, whole.train_y[:2560])
    assert torch.equal(lim.test_x, whole.test_x[:500]) and torch.equal(lim.test_y, whole.test_y[:500])


def test_count_mismatch_and_bad_labels(tmp_path):
    make_mnist_dir(tmp_path / "m")
    write_idx(tmp_path / "m/train-labels-idx1-ubyte.gz", np.zeros(49), gz=True)
    for lim in (0, 10):           # a limited read compares the files' counts from their headers
        with pytest.raises(DataError, match="50 images but train-labels-idx1-ubyte.gz 49 labels"):
            load_dataset("mnist", str(tmp_path / "m"), train_limit=lim)
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


def test_augment_all_offsets_flip_rate_and_channels_together():
    """Over 4000 images: every one of the (2*4+1)^2 = 81 crop offsets appears, about half
    the images are flipped, and all channels of an image get the same crop and flip."""
    n, h, pad = 4000, 8, 4
    pos = (torch.arange(h * h) + 1).view(h, h)                 # each pixel names its source (1..64)
    x = torch.stack([pos, pos + 100, pos + 150]).to(torch.uint8).unsqueeze(0).expand(n, 3, h, h).contiguous()
    out = augment_batch(x, torch.Generator().manual_seed(5), pad=pad).long()
    offsets, flips = set(), 0
    for b in range(n):
        c0 = out[b, 0]
        inside = c0 > 0
        # channels move together: the same pixels are padding, and the values keep their offsets
        assert torch.equal(out[b, 1] > 0, inside) and torch.equal(out[b, 2] > 0, inside)
        assert torch.equal((out[b, 1] - 100)[inside], c0[inside]) and torch.equal((out[b, 2] - 150)[inside], c0[inside])
        ii, jj = inside.nonzero(as_tuple=True)
        src = c0[ii, jj] - 1
        si, sj = src // h, src % h
        dy = set((si - ii + pad).tolist())
        row = ii == ii[0]
        flipped = bool(sj[row][1] < sj[row][0])               # source columns run backwards
        dx = set((sj + jj - (h - 1) + pad).tolist() if flipped else (sj - jj + pad).tolist())
        assert len(dy) == 1 and len(dx) == 1                   # one rigid shift per image
        offsets.add((dy.pop(), dx.pop()))
        flips += flipped
    assert offsets == {(a, b) for a in range(2 * pad + 1) for b in range(2 * pad + 1)}
    assert abs(flips / n - 0.5) < 0.05, flips / n


def test_windows_when_n_does_not_divide_N():
    """N = 11, n = 3: frac = 1/n gives disjoint windows that cover the data (sizes 3, 4, 4);
    a larger frac gives contiguous wrapping windows starting at floor(i*N/n); every
    replica gets the same number of batches per pass."""
    perm = replica_indices(11, rank=0, world=1, split="frac", frac=1.0, seed=7).tolist()
    assert window_bounds(11, 3, 1 / 3) == [(0, 3), (3, 4), (7, 4)]
    wins = [replica_indices(11, rank=i, world=3, split="frac", frac=1 / 3, seed=7).tolist() for i in range(3)]
    assert sorted(sum(wins, [])) == list(range(11))          # disjoint, and every example in one
    assert [len(w) for w in wins] == [3, 4, 4]
    half = [replica_indices(11, rank=i, world=3, split="frac", frac=0.5, seed=7).tolist() for i in range(3)]
    for i, w in enumerate(half):
        start = (i * 11) // 3
        assert w == [perm[(start + j) % 11] for j in range(len(w))]
    assert [len(w) for w in half] == [5, 6, 5] and half[2][-1] == perm[0]    # the last one wraps
    assert common_nb(11, world=3, split="frac", frac=1 / 3, batch_size=2) == 1
    assert common_nb(11, world=3, split="frac", frac=0.5, batch_size=2) == 2
    assert common_nb(11, world=3, split="full", frac=1.0, batch_size=2) == 5
    # an elastic joiner (replica id >= n) takes the window of id mod n, in its own order
    joiner = replica_indices(11, rank=4, world=3, split="frac", frac=0.5, seed=7)
    assert joiner.tolist() == half[1]
    a = ReplicaSampler(joiner, 2, seed=7, rank=4, nb=2).next().tolist()
    b = ReplicaSampler(torch.tensor(half[1]), 2, seed=7, rank=1, nb=2).next().tolist()
    assert a != b


@pytest.mark.parametrize("N,n", [(50000, 3), (100, 6), (60000, 7), (11, 3)])
def test_dpsgd_shards_are_disjoint_and_cover_the_data(N, n):
    """Data-parallel SGD's shards (frac = 1/n): no example twice, none left out; sizes
    differ by at most one; the sampler takes the same number of batches on every rank."""
    shards = [replica_indices(N, rank=r, world=n, split="frac", frac=1.0 / n, seed=42) for r in range(n)]
    allx = torch.cat(shards)
    assert len(allx) == N and len(torch.unique(allx)) == N
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    bs = 2 if N < 1000 else 128
    nb = common_nb(N, world=n, split="frac", frac=1.0 / n, batch_size=bs)
    assert all(ReplicaSampler(s, bs, seed=42, rank=r, nb=nb).nb == nb == min(sizes) // bs
               for r, s in enumerate(shards))


def test_random_streams_never_collide():
    """Every stream's generator differs from every other's, whatever the counters: the
    sampler at pass 166 is not the augmentation stream (0xA6 = 166 once made them equal)."""
    seeds = {}
    for r in range(8):
        for e in range(400):
            seeds[("sampler", r, e)] = _gen("sampler", 42, r, e).initial_seed()
        seeds[("augment", r)] = _gen("augment", 42, r).initial_seed()
        seeds[("langevin", r)] = _gen("langevin", 42, r).initial_seed()
    for step in range(400):
        seeds[("bn", step)] = _gen("bn", 42, step).initial_seed()
    seeds[("window",)] = _gen("window", 42).initial_seed()
    for c in range(400):
        seeds[("folder-split", c)] = _gen("folder-split", 42, c).initial_seed()
    assert len(set(seeds.values())) == len(seeds)
    assert _gen("sampler", 42, 0, 166).initial_seed() != _gen("augment", 42, 0).initial_seed()
    with pytest.raises(TypeError):
        _gen(42, 0, 166)                                     # the stream is named first


def test_validation_split_is_stratified_disjoint_and_fixed_by_the_seed():
    from parle_hvd.data import Dataset, hold_out
    g = torch.Generator().manual_seed(0)
    y = torch.arange(1000) % 4                                   # 250 per class
    x = torch.arange(1000).to(torch.int64).view(1000, 1, 1, 1)  # each image names its index
    ds = Dataset("t", x, y, x[:10], y[:10], 4, (0.5,), (0.5,))
    a, b, c = hold_out(ds, 0.1, seed=1), hold_out(ds, 0.1, seed=1), hold_out(ds, 0.1, seed=2)
    assert torch.bincount(a.val_y).tolist() == [25] * 4           # stratified
    tr, va = set(a.train_x.flatten().tolist()), set(a.val_x.flatten().tolist())
    assert not tr & va and len(tr | va) == 1000                   # disjoint, nothing lost
    assert torch.equal(a.val_x, b.val_x) and not torch.equal(a.val_x, c.val_x)
    assert torch.equal(a.test_x, ds.test_x)                       # the test set untouched
    assert all(int(i) % 4 == int(l) for i, l in zip(a.val_x.flatten(), a.val_y))   # labels follow their images
    with pytest.raises(DataError, match="data.val_frac"):
        hold_out(Dataset("t", x[:3], y[:3], x[:1], y[:1], 4, (0.5,), (0.5,)), 0.1, seed=0)


# --------------------------------------------------------------------------- data on the device (issue 14)
def _tiny_ds():
    from parle_hvd.data import Dataset
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 1, 8, 8), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (64,), generator=g)
    return Dataset("tiny", x, y, x[:16].clone(), y[:16].clone(), 10, (0.5,), (0.25,), x[:8].clone(), y[:8].clone())


def test_to_device_moves_every_tensor_once_and_batches_are_made_there():
    from parle_hvd.data import to_device
    ds = _tiny_ds()
    assert to_device(ds, "cpu") is ds                       # already there: no copy at all
    meta = torch.device("meta")                             # a device other than the CPU, without a GPU
    dm = to_device(ds, meta)
    assert all(getattr(dm, f).device == meta for f in ("train_x", "train_y", "test_x", "test_y", "val_x", "val_y"))
    assert ds.train_x.device.type == "cpu"                   # the host copy is left as it was
    s = ReplicaSampler(torch.arange(64), 16, seed=1, rank=0, device=meta)
    b = s.next()
    assert b.device == meta and dm.train_x[b].device == meta and dm.train_x[b].shape == (16, 1, 8, 8)
    # the order is the CPU sampler's, moved once per pass, not per batch
    ref = ReplicaSampler(torch.arange(64), 16, seed=1, rank=0)
    assert s._order.device == meta and torch.equal(ref.next(), ReplicaSampler(torch.arange(64), 16, seed=1, rank=0).next())


def test_to_input_constants_made_once_per_device_and_dtype():
    from parle_hvd.data import _norm_constants
    ds = _tiny_ds()
    _norm_constants.cache_clear()
    a = to_input(ds.train_x[:4], ds.mean, ds.std)
    b = to_input(ds.train_x[4:8], list(ds.mean), list(ds.std))
    info = _norm_constants.cache_info()
    assert info.misses == 1 and info.hits == 1
    want = (ds.train_x[:4].float() / 255 - 0.5) / 0.25
    assert torch.allclose(a, want, atol=1e-5) and b.dtype == torch.float32


def test_augment_draws_where_its_generator_lives():
    x = _tiny_ds().train_x[:8]
    g1, g2 = _gen("augment", 1, 0, device="cpu"), _gen("augment", 1, 0)
    assert g1.device.type == "cpu" and torch.equal(augment_batch(x, g1), augment_batch(x, g2))
