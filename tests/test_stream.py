"""Streamed data (stream.py, shards.py): the same batches as in memory, independence from the
number of workers, a restart at a saved position, the ImageNet recipe's transforms, tar
shards against the folder they were written from, corrupt files, stream=auto, the loading
heartbeat, and bad input."""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from parle_hvd import shards
from parle_hvd.assemble import load_data, streams
from parle_hvd.config import ConfigError, make_config
from parle_hvd.data import DataError, ReplicaSampler, _gen, decode_image, load_folder, rrc_box
from parle_hvd.stream import MemoryFeed, StreamFeed, ShardSampler, eval_batches, shard_windows, train_examples
from parle_hvd.watchdog import Watchdog

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def write_images(d: Path, per_class=(10, 4), classes=3, seed=0, modes=("RGB",), ext=".jpg"):
    """train/<class>/ and test/<class>/ of small images of mixed sizes (smooth, class-tinted)."""
    rng = np.random.default_rng(seed)
    for part, n in zip(("train", "test"), per_class):
        for c in range(classes):
            (d / part / f"k{c}").mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w, h = (int(v) for v in rng.integers(20, 90, 2))
                a = (rng.uniform(0, 255, (5, 5, 3)) * (c + 1) / classes).astype(np.uint8)
                im = Image.fromarray(a).resize((w, h), Image.BILINEAR).convert(modes[i % len(modes)])
                e = ".png" if im.mode in ("P", "RGBA", "LA", "I;16") else ext
                im.save(d / part / f"k{c}" / f"{i:03d}{e}")
    return d


def cfg_of(d, *extra):
    return make_config(None, ["data.name=folder", f"data.dir={d}", "data.image_size=16", "train.batch_size=6",
                              *extra])


def feed(ds, cfg, *, replica=0, nb=None, augment=None):
    s = ReplicaSampler(torch.arange(ds.n_train), cfg.train.batch_size, seed=7, rank=replica, nb=nb)
    aug = augment if augment is not None else cfg.data.augment
    kind = StreamFeed if ds.streamed else MemoryFeed
    kw = dict(dev=CPU, replica=replica, seed=7) if ds.streamed else {}
    return kind(ds, s, augment=aug, aug_gen=_gen("augment", 7, replica), **kw)


def take(f, n):
    return [tuple(t.clone() for t in f.next()) for _ in range(n)]


def test_streamed_folder_gives_the_in_memory_batches_to_the_bit(tmp_path):
    """Same decoder, same sampler, same statistics (the sample is the whole set): the
    streamed folder's batches, with 2 workers, and its evaluation batches are the in-memory ones."""
    d = write_images(tmp_path / "f", modes=("RGB", "L", "P", "RGBA", "CMYK"))
    mem = load_data(cfg_of(d, "data.stream=false", "data.augment=crop"))
    st = load_data(cfg_of(d, "data.stream=true", "data.workers=2", "data.augment=crop"))
    assert not mem.streamed and st.streamed
    assert st.mean == mem.mean and st.std == mem.std and st.shape == mem.shape == (3, 16, 16)
    a, b = take(feed(mem, cfg_of(d, "data.augment=crop")), 12), take(feed(st, cfg_of(d, "data.augment=crop")), 12)
    for (xa, ya), (xb, yb) in zip(a, b):                 # two passes: 5 batches each, then the third
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    ev = list(eval_batches(st, "test", 0, len(st.test), 5))
    assert torch.equal(torch.cat([x for x, _ in ev]), mem.test_x) and torch.equal(torch.cat([y for _, y in ev]), mem.test_y)


def test_in_memory_stats_are_exact_integer_sums(tmp_path):
    d = write_images(tmp_path / "f")
    ds = load_folder(str(d), 16)
    f = ds.train_x.double() / 255
    assert ds.mean == pytest.approx(tuple(f.mean(dim=(0, 2, 3)).tolist()), rel=1e-12)
    assert ds.std == pytest.approx(tuple(f.std(dim=(0, 2, 3)).tolist()), rel=1e-9)


def test_imagenet_recipe_is_independent_of_workers_and_resumes_at_a_position(tmp_path):
    """A streamed example's random crop depends on (seed, replica, pass, position) only:
    0 and 2 workers give the same batches; a feed restarted at a saved position gives the
    batches that followed it, and two replicas differ."""
    d = write_images(tmp_path / "f")
    c0 = cfg_of(d, "data.augment=imagenet", "data.workers=0")
    ds0, ds2 = load_data(c0), load_data(cfg_of(d, "data.augment=imagenet", "data.workers=2"))
    a, b = take(feed(ds0, c0), 9), take(feed(ds2, c0), 9)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    f = feed(ds2, c0)
    take(f, 4)
    saved = f.sampler.state_dict()
    rest = take(f, 5)
    g = feed(ds2, c0)
    g.sampler.load_state_dict(saved)
    g.reset()
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(rest, take(g, 5)))
    assert not torch.equal(take(feed(ds0, c0, replica=1), 1)[0][0], a[0][0])


def test_imagenet_recipe_run_leaves_a_final_pt_usable_alone(tmp_path):
    """train.py with the ImageNet recipe on images of mixed sizes and modes: final.json says
    how a test image becomes the model's input (the shorter side resized, the central crop,
    the statistics of the training sample), and final.pt with that card alone gives the
    run's own test accuracy, image for image."""
    from parle_hvd.data import folder_split, to_input
    from parle_hvd.models import build_model
    d = write_images(tmp_path / "f", modes=("RGB", "L", "P", "RGBA"))
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/fashion_parle.yaml", "data.name=folder",
                        f"data.dir={d}", "data.image_size=28", "data.augment=imagenet", "data.workers=1",
                        "train.batch_size=6", "parle.sync_period=5", "train.epochs=2", "run.tensorboard=false",
                        f"run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s, card = (json.loads((run / f).read_text()) for f in ("summary.json", "final.json"))
    inp = card["input"]
    assert s["data_streamed"] and inp["shape"] == [3, 28, 28] and inp["crop_frac"] == 0.875
    assert "central" in inp["resize"] and len(inp["mean"]) == len(inp["std"]) == 3
    net = build_model(card["model"]["name"], num_classes=card["num_classes"], in_channels=3, image_size=28)
    net.load_state_dict(torch.load(run / "final.pt", weights_only=True))
    _, _, test = folder_split(str(d))
    x = torch.stack([torch.from_numpy(decode_image(f, size=28, gray=False, recipe="eval",
                                                   crop_frac=inp["crop_frac"])) for f, _ in test])
    y = torch.tensor([label for _, label in test])
    with torch.no_grad():
        logits = net.eval()(to_input(x, inp["mean"], inp["std"]))
    right = int((logits.argmax(1) == y).sum())
    assert len(test) == 12 and right / len(test) == pytest.approx(s["test_accuracy"], abs=1e-12), (right, s)
    # the mean loss too, which any other crop, resize or statistics would move
    loss = float(torch.nn.functional.cross_entropy(logits.double(), y))
    assert loss == pytest.approx(s["test_loss"], rel=1e-5), (loss, s["test_loss"])


def test_rrc_and_center_crop_boxes():
    rng = random.Random(3)
    fracs = []
    for _ in range(500):
        w, h = rng.randint(100, 400), rng.randint(100, 400)    # (rounding moves a tiny image's area)
        x0, y0, x1, y1 = rrc_box(w, h, rng)
        assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
        fracs.append((x1 - x0) * (y1 - y0) / (w * h))
    assert min(fracs) >= 0.075 and max(fracs) <= 1.0 and np.median(fracs) < 0.7
    assert rrc_box(300, 200, random.Random(1)) == rrc_box(300, 200, random.Random(1))
    im = Image.fromarray(np.arange(40 * 60, dtype=np.uint16).reshape(40, 60).astype(np.uint8)).convert("RGB")
    p = Path("/tmp") / f"parle-center-{time.time_ns()}.png"
    im.save(p)
    out = decode_image(str(p), size=35, gray=False, recipe="eval", crop_frac=0.875)
    p.unlink()
    assert out.shape == (3, 35, 35)     # the central 35 x 35 of the 40-pixel shorter side: no resize
    assert np.array_equal(out[0], np.asarray(im)[2:37, 12:47, 0])


def test_large_jpeg_is_decoded_at_reduced_scale(tmp_path):
    """Resize at decode: a 1600 x 1200 JPEG at size 32 is drafted (libjpeg's 1/8 scale), and
    the result is close to decoding it whole and resizing."""
    a = (np.random.default_rng(0).uniform(0, 255, (12, 16, 3))).astype(np.uint8)
    Image.fromarray(a).resize((1600, 1200), Image.BILINEAR).save(tmp_path / "big.jpg", quality=90)
    fast = decode_image(str(tmp_path / "big.jpg"), size=32, gray=False)
    with Image.open(tmp_path / "big.jpg") as im:
        im.draft("RGB", (32, 32))
        assert im.size[0] <= 1600 // 8 + 1
    full = np.asarray(Image.open(tmp_path / "big.jpg").convert("RGB").resize((32, 32), Image.BILINEAR))
    assert np.abs(fast.transpose(1, 2, 0).astype(int) - full.astype(int)).mean() < 6


def test_shards_round_trip_and_give_the_folders_samples_per_pass(tmp_path):
    """The writer copies each image's bytes and label (the index and a header scan agree);
    a pass over the shards visits every training example of the folder exactly once, decoding
    to the folder's pixels; dpsgd's shard windows are disjoint and cover every shard."""
    d = write_images(tmp_path / "f", per_class=(12, 4))
    c = shards.write(str(d), str(tmp_path / "s"), per_shard=5, seed=3)
    assert c == {"classes": 3, "train": 36, "test": 12, "train_shards": 8, "test_shards": 3}
    assert json.loads((tmp_path / "s/classes.json").read_text()) == ["k0", "k1", "k2"]
    src = {}
    for y, k in enumerate(["k0", "k1", "k2"]):
        for p in sorted((d / "train" / k).iterdir()):
            src[p.read_bytes()] = y
    got = {}
    for f in shards.shard_files(tmp_path / "s/train"):
        idx = shards.shard_index(f)
        side = f.with_name(f.name[:-4] + ".idx.json")
        side.rename(tmp_path / "aside.json")
        assert shards.shard_index(f) == idx                  # the header scan reads what the index says
        side.parent.joinpath(side.name).write_bytes((tmp_path / "aside.json").read_bytes())
        raw = f.read_bytes()
        for key, off, size, label in idx:
            got[raw[off:off + size]] = label
    assert got == src
    sh = load_data(make_config(None, ["data.name=shards", f"data.dir={tmp_path / 's'}", "data.image_size=16",
                                      "train.batch_size=6", "data.workers=2", "data.shuffle_shards=2"]))
    fo = load_data(cfg_of(d, "data.stream=true"))
    assert sh.mean == fo.mean and sh.std == fo.std
    per_shard, windows = shard_windows(sh, world=1, split="full", frac=1.0, seed=42)
    s = ShardSampler(per_shard, windows[0], 6, seed=42, rank=0, nb=6, group=2)
    f = StreamFeed(sh, s, augment="off", aug_gen=None, dev=CPU, replica=0, seed=42)
    key = lambda x, y: (x.numpy().tobytes(), int(y))
    folder = sorted(key(x, y) for xb, yb in train_examples(fo, [torch.arange(36)]) for x, y in zip(xb, yb))
    for _ in range(2):                                       # two passes, each in its own order
        seen = sorted(key(x, y) for xb, yb in take(f, 6) for x, y in zip(xb, yb))
        assert seen == folder
    f.close()
    # resumed in the middle of a pass (4 of its 6 batches taken), across the next pass's start
    mk = lambda: StreamFeed(sh, ShardSampler(per_shard, windows[0], 6, seed=42, rank=0, nb=6, group=2),
                            augment="off", aug_gen=None, dev=CPU, replica=0, seed=42)
    f = mk()
    take(f, 4)
    saved = f.sampler.state_dict()
    rest = take(f, 5)
    g = mk()
    g.sampler.load_state_dict(saved)
    g.reset()
    assert all(torch.equal(x, y) and torch.equal(a, b) for (x, a), (y, b) in zip(rest, take(g, 5)))
    f.close()
    g.close()
    _, w2 = shard_windows(sh, world=2, split="frac", frac=0.5, seed=42)
    assert not set(w2[0]) & set(w2[1]) and sorted(w2[0] + w2[1]) == list(range(8))


def test_tables_are_packed_buffers_the_workers_share():
    """A table's references are numpy buffers, not Python lists whose reference counts a
    forked worker would write (copying every page of a million-path list): the same items
    back, through subset and pickling (spawn and forkserver workers are sent the table),
    names that are not UTF-8 included; the shards' per-shard index equals a plain loop's."""
    import pickle
    from parle_hvd.stream import Strings, Table
    paths = [f"/d/c{i % 3}/img_{i}.jpg" for i in range(50)] + ["/d/c0/é.png", "/d/c1/\udcff.jpg"]
    t = Table("files", paths, torch.arange(len(paths)))
    assert isinstance(t.refs, Strings) and isinstance(t.refs.buf, np.ndarray) and list(t.refs) == paths
    sub = t.subset([51, 3, 50])
    assert [sub.name(i) for i in range(3)] == [paths[51], paths[3], paths[50]] and sub.labels.tolist() == [51, 3, 50]
    back = pickle.loads(pickle.dumps(t))
    assert list(back.refs) == paths and t.read(51) == paths[51]
    rows = [(s, 100 * i, 7 + i) for i, s in enumerate([2, 0, 2, 1, 0, 2])]
    sh = Table("shards", rows, torch.zeros(6, dtype=torch.int64), ["a.tar", "b.tar", "c.tar"], names=list("uvwxyz"))
    assert sh.refs.dtype == np.int64 and sh.refs.shape == (6, 3) and sh.shard_row(2) == (2, 200, 9)
    assert sh.name(3) == "b.tar:x" and sh.subset([5, 0]).name(0) == "c.tar:z"
    loop: dict = {}
    for i, (s, _, _) in enumerate(rows):
        loop.setdefault(s, []).append(i)
    class _D:
        train = sh
    per_shard, _ = shard_windows(_D, world=1, split="full", frac=1.0, seed=0)
    assert {s: v.tolist() for s, v in per_shard.items()} == loop
    tt = Table("target", list(range(5)), None)
    assert tt.refs.dtype == np.int64 and tt.subset([4, 1]).name(0) == "example 4"
    # a forkserver or spawn worker is sent its own table and the options, not every split
    from parle_hvd.stream import Decoder, StreamedData
    d = StreamedData("folder", t, sub, None, 3, (0.5,), (0.2,), (3, 8, 8), size=8)
    dec = pickle.loads(pickle.dumps(Decoder(d, sub, "eval")))
    assert dec.d.train is None and dec.d.test is None and dec.d.size == 8 and list(dec.t.refs) == list(sub.refs)
    assert d.train is t                                       # the rank's own copy is untouched


def test_shard_sampler_orders_differ_by_replica_and_pass():
    per = {s: torch.arange(s * 10, s * 10 + 10) for s in range(6)}
    a = ShardSampler(per, list(range(6)), 10, seed=1, rank=0, nb=6, group=2)
    b = ShardSampler(per, list(range(6)), 10, seed=1, rank=1, nb=6, group=2)
    pa0, pa1, pb0 = a.plan(0)[1], a.plan(1)[1], b.plan(0)[1]
    assert sorted(pa0.tolist()) == list(range(60)) and not torch.equal(pa0, pa1) and not torch.equal(pa0, pb0)
    groups, order, gid = a.plan(0)
    for g, members in enumerate(groups):                     # a group's examples come from its shards only
        assert set((order[gid == g] // 10).tolist()) == set(members)


def test_a_feed_or_generator_dropped_mid_pass_ends_its_workers_at_once(tmp_path):
    """A feed dropped in the middle of a pass without close() (a user's loop that breaks
    out), or an evaluation generator left after one batch: the workers are joined as it is
    freed, with the garbage collector off. (A reference cycle through the DataLoader left
    them to the collector, which closes the queues first: 10 s per worker, seen here.)"""
    import gc
    import psutil
    d = write_images(tmp_path / "f")
    c = cfg_of(d, "data.stream=true", "data.workers=2")
    ds = load_data(c)
    me = psutil.Process()
    alive = lambda: [p for p in me.children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    before = {p.pid for p in alive()}
    gc.disable()
    try:
        f = feed(ds, c)
        take(f, 3)
        started = [p for p in alive() if p.pid not in before]
        assert len(started) == 2
        del f
        assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        g = train_examples(ds, [[0, 1], [2, 3], [4, 5]])
        next(g)
        started = [p for p in alive() if p.pid not in before]
        assert len(started) == 2
        del g
        assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        gc.enable()


def test_corrupt_image_one_line_or_skipped_and_counted(tmp_path):
    d = write_images(tmp_path / "f")
    (d / "train/k1/zz-bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    with pytest.raises(DataError, match=r"zz-bad\.jpg: unreadable or corrupt image"):
        load_data(cfg_of(d, "data.stream=true", "data.workers=1"))
    ds = load_data(cfg_of(d, "data.stream=true", "data.workers=1", "data.skip_corrupt=true"))
    f = feed(ds, cfg_of(d), nb=None)
    batches = take(f, 5)                                     # one pass: the bad file is in it once
    assert f.skipped == 1 and all(x.shape == (6, 3, 16, 16) for x, _ in batches)
    bad = [i for i, p in enumerate(ds.train.refs) if p.endswith("zz-bad.jpg")][0]
    sub = list(train_examples(ds, [[bad + 1]]))[0][0][0]     # its place goes to the next image
    assert any(torch.equal(sub, x) for xb, _ in batches for x in xb)
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/fashion_parle.yaml", "data.name=folder",
                        f"data.dir={d}", "data.image_size=16", "data.stream=true", f"run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("error: ") and "zz-bad.jpg: unreadable or corrupt image (OSError)" in last
    # skipped: counted in summary.json, and in every checkpoint (a resume goes on counting from it)
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/fashion_parle.yaml", "data.name=folder",
                        f"data.dir={d}", "data.image_size=28", "data.stream=true", "data.skip_corrupt=true",
                        "train.batch_size=6", "parle.sync_period=5", "train.epochs=2", "run.ckpt_every=1",
                        "run.tensorboard=false", f"run.dir={tmp_path / 'skip'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "skip/summary.json").read_text())
    assert s["data_corrupt_skipped"] == 2                    # two passes, the bad file once in each
    # data.image_size=0 takes the first training image's width: the first readable one's
    first = sorted((d / "train").rglob("*.jpg"))[0]
    first.write_bytes(b"not an image")
    with pytest.raises(DataError, match=rf"{first.name}: unreadable or corrupt image"):
        load_data(cfg_of(d, "data.stream=true", "data.image_size=0"))
    ds = load_data(cfg_of(d, "data.stream=true", "data.image_size=0", "data.skip_corrupt=true"))
    with Image.open(sorted((d / "train").rglob("*.jpg"))[1]) as im:
        assert ds.shape[1:] == (im.size[0], im.size[0])
    cks = sorted((tmp_path / "skip").rglob("rank-0.pt"))
    assert cks and torch.load(cks[-1], weights_only=True)["data_skipped"] == 2


class _UserSet(torch.utils.data.Dataset):
    """A user's dataset: a label a tensor cannot hold, a worker that dies, a worker that
    never returns, or ("ok": its lambda) one that cannot be pickled for a spawned worker."""

    def __init__(self, how):
        self.how, self.f = how, ((lambda: 0) if how == "ok" else None)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if self.how == "die":
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "stuck":
            import time
            time.sleep(600)
        return torch.zeros(2), ("seven" if self.how == "label" else 1)


@pytest.mark.parametrize("how,context,msg", [
    ("label", "fork", r"^data: decoding a batch raised (TypeError|ValueError)"),
    ("die", "fork", r"^data.workers \(train\): DataLoader worker \(pid"),
    ("die", "forkserver", r"^data.workers \(train\): DataLoader worker \(pid"),    # not our child: no SIGCHLD
    ("ok", "spawn", r"^data.worker_start: the dataset cannot be sent to a worker process"),
])
def test_a_workers_failure_is_one_line(how, context, msg):
    from parle_hvd.stream import StreamedData, Table
    t = Table("target", list(range(8)), None, ds=_UserSet(how))
    d = StreamedData("t", t, t, None, 2, None, None, (2,), input_dtype="float32", workers=1, context=context)
    with pytest.raises(DataError, match=msg) as e:
        list(train_examples(d, [[0, 1, 2, 3]]))
    assert "\n" not in str(e.value)


def test_a_stuck_worker_is_named_with_its_stack(capfd):
    """A worker that never returns a batch (a __getitem__ stuck on a dead mount, or a
    deadlock): after the stall limit (half of dist.timeout) the rank prints the live
    workers' Python stacks and stops with one line, rather than wait until another rank's
    watchdog ends the job without saying why."""
    from parle_hvd.stream import StreamedData, Table
    t = Table("target", list(range(8)), None, ds=_UserSet("stuck"))
    d = StreamedData("t", t, t, None, 2, None, None, (2,), input_dtype="float32", workers=1, stall=4)
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"^data.workers \(train\): no batch in 4 s \(the limit dist.timeout sets\) "
                                        r"from 1 live worker process\(es\) \(pid \d+\): one is stuck") as e:
        list(train_examples(d, [[0, 1, 2, 3]]))
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 20          # the stuck worker was ended, not left to its 120 s grace
    err = capfd.readouterr().err
    assert "no batch from the DataLoader workers in 4 s; their stacks:" in err and "in __getitem__" in err, err
    pid = int(str(e.value).split("(pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_datasets_class_from_a_file_reaches_forkserver_workers():
    """data.target=path/to/file.py:make imports the file under a name made from its path:
    a forkserver worker (data.worker_start=auto in a multi-rank job) imports the file again
    before it unpickles the dataset, whose class lives there, and decodes the same examples
    as a forked one."""
    from parle_hvd.stream import StreamedData, Table
    from parle_hvd.targets import load_target
    _, test, _ = load_target(str(ROOT / "tests/user_code/data.py") + ":make", "data.target")(n_train=8, n_test=8)
    assert type(test).__module__.startswith("parle_hvd_user_")      # Pairs, not a torch class
    t = Table("target", list(range(8)), None, ds=test)
    got = {}
    for ctx in ("fork", "forkserver"):
        d = StreamedData("t", t, t, None, 4, None, None, (8,), input_dtype="float32", workers=1, context=ctx)
        got[ctx] = list(train_examples(d, [[0, 1, 2], [5, 7]]))
    for (xa, ya), (xb, yb) in zip(got["fork"], got["forkserver"]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(got["forkserver"][1][0], torch.stack([test[5][0], test[7][0]]))


def test_stream_auto_follows_the_memory_limit(tmp_path):
    d = write_images(tmp_path / "f")
    assert not streams(cfg_of(d))                             # 48 images of 3x16x16: far below 4 GiB
    assert streams(cfg_of(d, "data.memory_limit=0.00001"))
    assert streams(cfg_of(d, "data.augment=imagenet"))
    assert not streams(make_config(None, ["data.name=fashion-mnist"]))


def test_streamed_data_target_matches_in_memory(tmp_path):
    c = lambda s: make_config(None, ["data.target=tests/user_code/data.py:make", "data.kwargs={n_train: 64, n_test: 16}",
                                     "model.target=usermods.nets:make_mlp", f"data.stream={s}", "data.workers=2"])
    sys.path.insert(0, str(ROOT / "tests/user_code"))
    try:
        mem, st = load_data(c("false")), load_data(c("true"))
    finally:
        sys.path.remove(str(ROOT / "tests/user_code"))
    assert st.streamed and st.shape == mem.shape
    s = lambda: ReplicaSampler(torch.arange(64), 8, seed=1, rank=0)
    a = MemoryFeed(mem, s(), augment="off", aug_gen=None)
    b = StreamFeed(st, s(), augment="off", aug_gen=None, dev=CPU, replica=0, seed=1)
    for _ in range(10):
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_a_targets_random_transform_is_seeded_per_example(tmp_path):
    """A data.target whose __getitem__ draws from torch's, NumPy's and Python's generators:
    streamed, its draws depend on (seed, replica, pass, position) only: 0 and 2 workers give
    the same batches, a feed restarted at a saved position replays them, two replicas and
    two passes differ, and the training process's own generators are left as they were."""
    import random as pyrandom
    c = lambda w: make_config(None, ["data.target=tests/user_code/data.py:jittered", "model.target=usermods.nets:make_mlp",
                                     "data.stream=true", f"data.workers={w}"])
    sys.path.insert(0, str(ROOT / "tests/user_code"))
    try:
        st0, st2 = load_data(c(0)), load_data(c(2))
    finally:
        sys.path.remove(str(ROOT / "tests/user_code"))
    # replica r's feed over replica 0's order: the same examples, the draws alone differ
    mk = lambda ds, r=0: StreamFeed(ds, ReplicaSampler(torch.arange(64), 8, seed=1, rank=0), augment="off",
                                    aug_gen=None, dev=CPU, replica=r, seed=1)
    torch.manual_seed(5), np.random.seed(5), pyrandom.seed(5)
    before = torch.get_rng_state(), np.random.rand(), pyrandom.random()
    torch.manual_seed(5), np.random.seed(5), pyrandom.seed(5)
    f0 = mk(st0)
    a = take(f0, 16)                                     # two passes of 8 batches, in this process
    assert (torch.equal(torch.get_rng_state(), before[0]) and np.random.rand() == before[1]
            and pyrandom.random() == before[2])
    f2 = mk(st2)
    b = take(f2, 16)
    assert all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))
    # torch's draws: x[:, 0] - x[:, 1] (the other two terms and the example's own value cancel)
    jit = lambda batches: sorted(round(float(v), 5) for x, _ in batches for v in x[:, 0] - x[:, 1])
    assert jit(a[:8]) != jit(a[8:])                      # the same examples, other draws in the next pass
    (x1, y1), = take(mk(st0, r=1), 1)
    assert torch.equal(y1, a[0][1]) and jit([(x1, y1)]) != jit(a[:1])        # the same examples, other draws
    ev = [x for x, _ in eval_batches(st2, "test", 0, 16, 5)]
    assert all(torch.equal(x, y) for x, y in zip(ev, [x for x, _ in eval_batches(st0, "test", 0, 16, 5)]))
    assert len(set(jit([(torch.cat(ev), None)]))) == 16  # each test example its own draws
    g = mk(st2)
    take(g, 5)
    saved = g.sampler.state_dict()
    h = mk(st2)
    h.sampler.load_state_dict(saved)
    h.reset()
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(take(h, 6), b[5:11]))
    for f in (f0, f2, g, h):
        f.close()


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    """A 16-bit grayscale PNG (PIL mode I;16) becomes its top byte, not white."""
    a = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    Image.fromarray(a).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    gray = decode_image(str(tmp_path / "g16.png"), size=32, gray=True)
    assert np.array_equal(gray[0], (a >> 8).astype(np.uint8))
    rgb = decode_image(str(tmp_path / "g16.png"), size=32, gray=False)
    assert all(np.array_equal(rgb[c], gray[0]) for c in range(3))


def test_a_corrupt_shard_member_is_one_short_line_naming_it(tmp_path):
    """Met while the image modes are read at the start: the line names the shard and key
    (not the member's bytes)."""
    d = write_images(tmp_path / "f", per_class=(6, 2))
    shards.write(str(d), str(tmp_path / "s"), per_shard=4, seed=3)
    f = shards.shard_files(tmp_path / "s/train")[0]
    key, off, size, _ = shards.shard_index(f)[0]
    raw = bytearray(f.read_bytes())
    raw[off:off + 8] = b"garbage!"
    f.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        load_data(make_config(None, ["data.name=shards", f"data.dir={tmp_path / 's'}", "data.image_size=16",
                                     "train.batch_size=6", "data.stats_sample=100000"]))
    msg = str(e.value)
    assert len(msg) < 300 and key in msg and f.name in msg and "corrupt" in msg, msg[:500]


def test_a_targets_items_count_as_loading_progress():
    """Stacking an in-memory data.target reads it item by item: the heartbeat's count moves."""
    from parle_hvd import data as D
    sys.path.insert(0, str(ROOT / "tests/user_code"))
    try:
        p0 = D.PROGRESS[0]
        load_data(make_config(None, ["data.target=tests/user_code/data.py:jittered", "model.target=usermods.nets:make_mlp",
                                     "data.stream=false"]))
        assert D.PROGRESS[0] - p0 >= 64 + 16
    finally:
        sys.path.remove(str(ROOT / "tests/user_code"))


@pytest.mark.parametrize("override,msg", [
    ("data.stream=maybe", "data.stream"), ("data.workers=-1", "data.workers"), ("data.augment=sometimes", "data.augment"),
    ("data.memory_limit=0", "data.memory_limit"), ("data.shuffle_shards=0", "data.shuffle_shards")])
def test_bad_stream_config_names_the_key(override, msg):
    with pytest.raises(ConfigError, match=msg):
        make_config(None, ["data.name=folder", "data.dir=/x", override])


def test_stream_config_combinations():
    with pytest.raises(ConfigError, match="data.image_size"):
        make_config(None, ["data.name=folder", "data.dir=/x", "data.augment=imagenet"])
    with pytest.raises(ConfigError, match="data.stream"):
        make_config(None, ["data.name=cifar10", "data.stream=true"])
    with pytest.raises(ConfigError, match="data.augment"):
        make_config(None, ["data.name=folder", "data.dir=/x", "data.image_size=8", "data.augment=imagenet",
                           "data.stream=false"])
    assert make_config(None, ["data.augment=true"]).data.augment == "crop"
    assert make_config(None, ["data.augment=false"]).data.augment == "off"


def test_loading_counts_progress_before_any_image_is_decoded(tmp_path):
    """The heartbeat's count moves while a folder is listed, headers are read and shards are
    scanned (a million files take minutes of that before the first decode)."""
    from parle_hvd import data as D
    d = write_images(tmp_path / "f", per_class=(5, 2))           # 3 classes: 21 files
    c = shards.write(str(d), str(tmp_path / "s"), per_shard=4, seed=3)
    p0 = D.PROGRESS[0]
    _, train, test = D.folder_split(str(d))
    assert D.PROGRESS[0] - p0 == 21
    p0 = D.PROGRESS[0]
    D.is_gray(f for f, _ in train)
    assert D.PROGRESS[0] - p0 == 15
    for f in shards.shard_files(tmp_path / "s/train"):
        f.with_name(f.name[:-4] + ".idx.json").unlink()          # scan the tar's headers
    p0 = D.PROGRESS[0]
    shards.read_shards(str(tmp_path / "s"))
    assert D.PROGRESS[0] - p0 >= 2 * c["train"] + c["test"]        # every .jpg and .cls member, and the index


def test_watchdog_waits_on_a_loading_rank_while_it_makes_progress(tmp_path):
    """A busy rank's heartbeat carries a progress count: behind it, but moving, it is not
    named; once its count stops for dist.timeout it is, with what it was doing."""
    me = Watchdog(0, 0, 2)
    me.timeout = 1.0
    me.attach(tmp_path)
    other = Watchdog(0, 1, 2)
    other.attach(tmp_path)
    other.BUSY_EVERY = 0.1
    prog = [0]
    me._n = 1                                  # rank 0 waits in its first collective
    with other.busy("loading data", lambda: prog[0]):
        for _ in range(15):                    # 1.5 s > timeout, but moving
            prog[0] += 1
            time.sleep(0.1)
            assert me.behind() == [] and me.waiting_on_busy()
        time.sleep(1.3)                        # stuck: no progress for longer than the timeout
        late = me.behind()
    assert len(late) == 1 and late[0][0] == 1 and "loading data, 15 items, no progress for" in late[0][2]
    assert not me._read(1)[2].startswith("busy:")      # the block ended: rank 1 is an ordinary late rank now
    assert me.behind() == [(1, 0, "none")] and not me.waiting_on_busy()


def test_watchdog_judges_heartbeats_by_its_own_clock(tmp_path):
    """Rank 1's host clock is days behind (its heartbeats carry that time): while its lines
    keep changing it is alive; once they stop for dist.timeout, it is named for that. An
    elastic reset forgets what was seen of the old world's ranks."""
    me = Watchdog(0, 0, 2)
    me.timeout, me.BUSY_EVERY = 0.6, 0.1       # a heartbeat older than max(5 beats, timeout) is stale
    me.attach(tmp_path)
    me._n = 1
    hb = tmp_path / ".heartbeat/rank-1"
    skewed = 1000.0                            # 1970: another host's clock, not ours
    for i in range(10):                        # 1 s > timeout: beats and progress, a skewed clock
        hb.write_text(f"0 0 busy:loading_data {skewed + i:.3f} {i}\n")
        assert me.behind() == [] and me.waiting_on_busy()
        time.sleep(0.1)
    time.sleep(0.8)                            # the heartbeat stops (the same line, read again)
    late = me.behind()
    assert len(late) == 1 and "loading data, 9 items, no heartbeat for" in late[0][2], late
    assert me._moved and me._beats
    me.reset(0, 2)
    assert me._moved == {} and me._beats == {} and me._n == 0


def test_a_streamed_run_that_fails_mid_training_exits_without_hanging(tmp_path):
    """A divergence (injected NaN at outer step 2) with 2 live workers: exit 3 at once, the
    workers ended by the trainer (they ignore SIGTERM, so exit could not end them)."""
    d = write_images(tmp_path / "f", per_class=(20, 4))
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/fashion_parle.yaml", "data.name=folder",
                        f"data.dir={d}", "data.image_size=28", "data.stream=true", "data.workers=2",
                        "train.batch_size=8", "parle.sync_period=2", "train.epochs=2", "run.tensorboard=false",
                        f"run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=90,
                       env={**__import__("os").environ, "PARLE_HVD_INJECT_NAN": "0:2"})
    assert r.returncode == 3 and "non-finite loss or weights" in r.stderr, r.stderr


def test_a_process_that_leaves_its_workers_running_still_exits(tmp_path):
    """Workers outlive a SIGTERM (the rank needs them until its checkpoint), so a feed nobody
    closed used to hold interpreter exit forever: multiprocessing's exit handler SIGTERMs and
    joins them. The atexit hook ends them first; this process exits at once, rc 0."""
    d = write_images(tmp_path / "f", per_class=(12, 3))
    script = f"""
import torch
from parle_hvd.assemble import load_data
from parle_hvd.config import make_config
from parle_hvd.data import ReplicaSampler, _gen
from parle_hvd.stream import StreamFeed, eval_batches
cfg = make_config(None, ["data.name=folder", "data.dir={d}", "data.image_size=16", "train.batch_size=4",
                         "data.stream=true", "data.workers=2"])
ds = load_data(cfg)
s = ReplicaSampler(torch.arange(ds.n_train), 4, seed=7, rank=0)
f = StreamFeed(ds, s, augment="off", aug_gen=_gen("augment", 7, 0), dev=torch.device("cpu"), replica=0, seed=7)
f.next()
g = eval_batches(ds, "test", 0, 8, 2)
next(g)
print("left open", flush=True)
"""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "left open" in r.stdout, r.stderr
    assert time.monotonic() - t0 < 30
