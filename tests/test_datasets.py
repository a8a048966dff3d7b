"""CIFAR-10/100 pickles, SVHN .mat and image folders: small files in each real on-disk
format written here, read back, bad files rejected with one clear line, and one training
step on a tiny CIFAR-10 and a tiny image folder."""
import json
import math
import pickle

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

from parle_hvd.config import make_config
from parle_hvd.data import DataError, load_dataset
from parle_hvd.models import build_model, count_params
from parle_hvd.trainer import train


def write_cifar10(root, n=20, seed=0):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    truth = {}
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, n)]
        with open(d / f, "wb") as fh:   # the real format: a pickled dict with bytes keys
            pickle.dump({b"batch_label": f.encode(), b"labels": y, b"data": x,
                         b"filenames": [b"x.png"] * n}, fh, protocol=2)
        truth[f] = (x, y)
    with open(d / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": [b"c%d" % i for i in range(10)], b"num_cases_per_batch": n}, fh)
    return d, truth


def write_cifar100(root, n=30, seed=1):
    d = root / "cifar-100-python"
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for f in ("train", "test"):
        x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        with open(d / f, "wb") as fh:
            pickle.dump({b"filenames": [b"a"] * n, b"batch_label": b"x", b"fine_labels": list(range(70, 70 + n)),
                         b"coarse_labels": [0] * n, b"data": x}, fh, protocol=2)
    return d


def test_cifar10_roundtrip_and_layout(tmp_path):
    d, truth = write_cifar10(tmp_path)
    for where in (tmp_path, d):          # the extracted folder or its parent
        ds = load_dataset("cifar10", str(where))
        assert ds.train_x.shape == (100, 3, 32, 32) and ds.test_x.shape == (20, 3, 32, 32)
        assert ds.train_x.dtype == torch.uint8 and ds.num_classes == 10
    x, y = truth["data_batch_2"]
    assert np.array_equal(ds.train_x[20:40].reshape(20, -1).numpy(), x)   # row-major 3x32x32, channel planes
    assert ds.train_y[20:40].tolist() == y


def test_cifar100_fine_labels(tmp_path):
    write_cifar100(tmp_path)
    ds = load_dataset("cifar100", str(tmp_path))
    assert ds.num_classes == 100 and ds.train_y.tolist() == list(range(70, 100))


def test_cifar_missing_and_corrupt(tmp_path):
    with pytest.raises(DataError, match=r"does not exist; expected data_batch_1.*cifar-10-python.tar.gz"):
        load_dataset("cifar10", str(tmp_path / "nope"))
    d, _ = write_cifar10(tmp_path)
    (d / "test_batch").unlink()
    with pytest.raises(DataError, match="lacks test_batch"):
        load_dataset("cifar10", str(tmp_path))
    (d / "test_batch").write_bytes((d / "data_batch_1").read_bytes()[:500])
    with pytest.raises(DataError, match="truncated or corrupt CIFAR pickle"):
        load_dataset("cifar10", str(tmp_path))


def write_svhn(d, n_train=12, n_test=6, extra=0, seed=2):
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("train", n_train), ("test", n_test), ("extra", extra)):
        if n == 0:
            continue
        X = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)     # SVHN format 2: HxWxCxN
        y = rng.integers(1, 11, (n, 1)).astype(np.uint8)              # labels 1..10, 10 = digit 0
        scipy.io.savemat(str(d / f"{name}_32x32.mat"), {"X": X, "y": y})


def test_svhn_mat_roundtrip_label_10_is_0(tmp_path):
    write_svhn(tmp_path / "s", extra=4)
    m = scipy.io.loadmat(str(tmp_path / "s/train_32x32.mat"))
    ds = load_dataset("svhn", str(tmp_path / "s"))
    assert ds.train_x.shape == (12, 3, 32, 32)
    assert torch.equal(ds.train_x[3], torch.from_numpy(m["X"][:, :, :, 3].transpose(2, 0, 1).copy()))
    want = m["y"].reshape(-1).astype(np.int64)
    want[want == 10] = 0
    assert ds.train_y.tolist() == want.tolist() and ds.train_y.max() <= 9
    cfg = make_config(None, ["data.name=svhn", f"data.dir={tmp_path / 's'}", "data.svhn_extra=true"]).data
    assert len(load_dataset("svhn", cfg=cfg).train_x) == 16
    (tmp_path / "s/test_32x32.mat").write_bytes(b"MATLAB 5.0 MAT-file garbage")
    with pytest.raises(DataError, match="test_32x32.mat: truncated or corrupt"):
        load_dataset("svhn", str(tmp_path / "s"))
    with pytest.raises(DataError, match="lacks train_32x32.mat"):
        load_dataset("svhn", str(tmp_path))


def write_folder(d, split=True, size=12, per_class=4, gray=False):
    rng = np.random.default_rng(3)
    for part in (("train", "test") if split else ("",)):
        for ci, cls in enumerate(("cat", "dog", "emu")):
            p = d / part / cls
            p.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                a = rng.integers(0, 256, (size, size) if gray else (size, size, 3), dtype=np.uint8)
                ext = ".png" if i % 2 == 0 else ".jpg"
                Image.fromarray(a).save(p / f"{i}{ext}")


def test_folder_train_test_png_jpeg(tmp_path):
    write_folder(tmp_path / "f")
    ds = load_dataset("folder", str(tmp_path / "f"))
    assert ds.num_classes == 3 and ds.train_x.shape == (12, 3, 12, 12) and ds.test_x.shape == (12, 3, 12, 12)
    assert sorted(set(ds.train_y.tolist())) == [0, 1, 2]
    png = np.asarray(Image.open(tmp_path / "f/train/dog/0.png"))
    assert np.array_equal(ds.train_x[4].numpy().transpose(1, 2, 0), png)      # lossless PNG read exactly
    assert len(ds.mean) == 3 and all(s > 0 for s in ds.std)


def test_folder_split_fraction_gray_and_resize(tmp_path):
    write_folder(tmp_path / "g", split=False, per_class=10, gray=True)
    cfg = make_config(None, ["data.name=folder", f"data.dir={tmp_path / 'g'}", "data.test_frac=0.2",
                             "data.image_size=8"]).data
    ds = load_dataset("folder", cfg=cfg)
    assert ds.train_x.shape == (24, 1, 8, 8) and ds.test_x.shape == (6, 1, 8, 8)
    (tmp_path / "g/cat/bad.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="bad.png: unreadable or corrupt image"):
        load_dataset("folder", cfg=cfg)
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("folder", str(tmp_path / "none"))


def _one_step(tmp_path, *over):
    cfg = make_config(None, ["dist.backend=none", f"run.dir={tmp_path / 'run'}", "run.progress=lines",
                             "run.tensorboard=false", "train.batch_size=8", "eval.bn_batches=1",
                             "eval.batch_size=16", *over])
    return train(cfg)


def _assert_trained(tmp_path, s, sd, model, classes, size):
    """The step moved the weights away from the initialisation (seed 42 + replica 0), and
    every loss it reports is finite."""
    torch.manual_seed(42)
    init = build_model(model, num_classes=classes, in_channels=3, image_size=size).state_dict()
    moved = [k for k, v in init.items() if v.is_floating_point() and "running" not in k and not torch.equal(v, sd[k])]
    assert len(moved) > len([k for k in init if "running" not in k and "num_batches" not in k]) // 2, moved
    lines = [json.loads(l) for l in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [l["train/loss"] for l in lines if "train/loss" in l] + [s["val_loss"]]
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), losses
    assert 0.0 <= s["val_accuracy"] <= 1.0


def test_folder_held_out_split_follows_the_seed(tmp_path):
    """dir/<class>/* without train/test: the held-out part is fixed by train.seed (the same
    seed, the same split; another seed, another split)."""
    write_folder(tmp_path / "g", split=False, per_class=10)
    cfg = make_config(None, ["data.name=folder", f"data.dir={tmp_path / 'g'}", "data.test_frac=0.3"]).data
    a, b = load_dataset("folder", cfg=cfg, seed=1), load_dataset("folder", cfg=cfg, seed=1)
    c = load_dataset("folder", cfg=cfg, seed=2)
    assert torch.equal(a.test_x, b.test_x)
    assert not torch.equal(a.test_x, c.test_x) and a.test_x.shape == c.test_x.shape


def test_train_one_step_on_tiny_cifar10(tmp_path):
    write_cifar10(tmp_path / "c")
    s = _one_step(tmp_path, "data.name=cifar10", f"data.dir={tmp_path / 'c'}", "model.name=allcnn",
                  "data.augment=true", "parle.sync_period=1", "train.epochs=0.05")
    assert s["outer_steps"] == 1 and s["inner_steps"] == 1
    sd = torch.load(tmp_path / "run/final.pt")
    _assert_trained(tmp_path, s, sd, "allcnn", 10, 32)
    assert sum(v.numel() for k, v in sd.items() if "running" not in k and "num_batches" not in k) == \
        count_params(build_model("allcnn", num_classes=10, in_channels=3, image_size=32))


def test_train_one_step_on_tiny_image_folder(tmp_path):
    write_folder(tmp_path / "f")
    s = _one_step(tmp_path, "data.name=folder", f"data.dir={tmp_path / 'f'}", "model.name=resnet18",
                  "algo=sgd", "train.block=1", "train.epochs=0.5")
    assert s["outer_steps"] == 1 and s["algo"] == "sgd"
    _assert_trained(tmp_path, s, torch.load(tmp_path / "run/final.pt"), "resnet18", 3, 12)
    assert json.loads((tmp_path / "run/summary.json").read_text())["params"] == \
        count_params(build_model("resnet18", num_classes=3, in_channels=3, image_size=12))
