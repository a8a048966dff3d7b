"""Streamed data on 2 ranks: a run killed with -9 in the middle of a pass (DataLoader workers
on) and resumed ends with the uninterrupted run's weights, bit for bit, for Parle on an image
folder (horovodrun --gloo) and dpsgd on tar shards (mpirun; each rank its own half of the
shards, a corrupt image in each shard skipped and counted on every rank); a streamed image
folder trains to the same weights and accuracy as the same folder held in memory; a rank
still loading its data is waited for, a stuck one named."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from multirank import ROOT, RankJob, kill9_after_first_checkpoint, run_ranks, run_sweep
from parle_hvd import checkpoint, shards
from parle_hvd.data import load_dataset

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.multirank, pytest.mark.horovod,
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]
TRAIN = ROOT / "tests/ranks/train_rank.py"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Fashion-MNIST's first 2560 training and 500 test images as a PNG folder (train/, test/)."""
    d = tmp_path_factory.mktemp("fashion-folder")
    ds = load_dataset("fashion-mnist", "", 2560, 500)
    for part, x, y in (("train", ds.train_x, ds.train_y), ("test", ds.test_x, ds.test_y)):
        for i in range(len(x)):
            (d / part / f"c{int(y[i])}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(x[i, 0].numpy()).save(d / part / f"c{int(y[i])}" / f"{i:05d}.png")
    return d


@pytest.fixture(scope="module")
def tar_shards(folder, tmp_path_factory):
    """The same images as 10 training shards of 256 (5 per dpsgd rank), the first image of
    each shard overwritten in place by zeros (the index still points at it): a corrupt file
    in every shard, so each rank skips 5 per pass."""
    d = tmp_path_factory.mktemp("fashion-shards") / "s"
    assert shards.write(str(folder), str(d), per_shard=256, seed=1)["train_shards"] == 10
    for f in shards.shard_files(d / "train"):
        _, off, size, _ = shards.shard_index(f)[0]
        with open(f, "r+b") as fh:
            fh.seek(off)
            fh.write(bytes(size))
    return d


def args(data, algo, run_dir, *extra):
    return ["--config", "configs/fashion_parle.yaml", f"algo={algo}", "data.name=folder", f"data.dir={data}",
            "data.stream=true", "data.workers=2", "data.stats_sample=5000", "parle.sync_period=5", "train.block=5",
            "train.batch_size=64", "train.epochs=2", "run.ckpt_every=3", "eval.every=1", "eval.bn_batches=5",
            "model.dtype=float64", "dist.threads=1", "run.tensorboard=false", "run.progress=lines",
            f"run.dir={run_dir}", *extra]


def final(d):
    return torch.load(d / "final.pt", weights_only=True)


@pytest.mark.parametrize("algo,controller,kind", [("parle", "gloo", "folder"), ("dpsgd", "mpi", "shards")])
def test_streamed_resume_after_kill9_mid_pass_is_bit_identical(tmp_path, request, algo, controller, kind):
    """In a multi-rank job data.worker_start=auto starts the workers from a fork server (no
    fork of a process running the engine's threads), under horovodrun --gloo as under mpirun:
    the killed rank's workers end with it, and the resumed run's workers start at the saved
    position all the same."""
    data = request.getfixturevalue({"folder": "folder", "shards": "tar_shards"}[kind])
    extra = [f"data.name={kind}", *(["data.skip_corrupt=true"] if kind == "shards" else [])]
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    if algo == "parle":     # with the same folder held in memory (below), in one start of the ranks
        run_sweep([args(data, algo, a, *extra), args(data, algo, m, "data.stream=false")], controller=controller,
                  timeout=500)
    else:
        run_ranks(TRAIN, controller=controller, args=args(data, algo, a, *extra), timeout=300, reports=False)
    job = RankJob([TRAIN, *args(data, algo, b, *extra)], controller=controller)
    killed_at = kill9_after_first_checkpoint(job, b)
    s_a = json.loads((a / "summary.json").read_text())
    assert not (b / "summary.json").exists() and killed_at < s_a["outer_steps"]
    nb = 40 if algo == "parle" else 20           # batches per pass: all 2560 (parle), or a rank's half (dpsgd)
    assert (killed_at * 5) % nb != 0             # the checkpoint is in the middle of a pass
    out = run_ranks(TRAIN, controller=controller, args=args(data, algo, b, *extra, "run.resume=true"), timeout=300,
                    reports=False)
    assert "resumed from checkpoint step" in out[0]["_output"]
    s_b = json.loads((b / "summary.json").read_text())
    assert s_a["data_streamed"] and s_a["data_workers"] == 2 and s_b["resumed_from"] >= killed_at
    assert s_a["controller"] == controller and s_a["data_worker_start"] == "forkserver"
    fa, fb = final(a), final(b)
    for k in fa:
        assert torch.equal(fa[k], fb[k]), k
    assert s_a["val_accuracy"] == s_b["val_accuracy"] and s_a["allreduce_calls"] == s_b["allreduce_calls"]
    if kind == "shards":
        # every rank's skips, summed: 5 shards a rank, one corrupt image in each, 2 passes
        last = checkpoint.step_dir(b, max(checkpoint.steps(b)))
        per_rank = [torch.load(last / f"rank-{r}.pt", weights_only=True)["data_skipped"] for r in range(2)]
        assert per_rank == [10, 10] and s_a["data_corrupt_skipped"] == s_b["data_corrupt_skipped"] == 20, per_rank
    if algo == "parle":
        # The held-out folder check, in memory: the same weights and test accuracy as streamed.
        s_m = json.loads((m / "summary.json").read_text())
        assert not s_m["data_streamed"] and s_m["val_accuracy"] == s_a["val_accuracy"] > 0.7
        fm = final(m)
        assert all(torch.equal(fa[k], fm[k]) for k in fa)


SHORT = ["--config", "configs/fashion_parle.yaml", "data.train_limit=512", "data.test_limit=200", "train.epochs=1",
         "parle.sync_period=4", "train.batch_size=64", "dist.timeout=2", "run.tensorboard=false", "dist.threads=1"]


def test_a_rank_slow_to_load_is_waited_for(tmp_path):
    """Rank 1 takes 8 s to load (its progress count moving), four times dist.timeout: the
    others wait for it and the run ends normally."""
    out = run_ranks(TRAIN, controller="gloo", args=[*SHORT, f"run.dir={tmp_path / 'r'}"], timeout=180,
                    env={"PARLE_HVD_INJECT_SLOW_LOAD": "1:8"}, reports=False)
    s = json.loads((tmp_path / "r/summary.json").read_text())
    assert s["outer_steps"] == 2 and "waited" not in out[0]["_output"]


def test_a_rank_stuck_loading_is_named(tmp_path):
    """Rank 1's loading stops making progress: rank 0 names it (still loading, no progress)
    after dist.timeout and exits 4, rather than wait forever or blame the network. The
    launcher's SIGTERM then ends rank 1 at once (nothing trained), not after its grace period."""
    out = run_ranks(TRAIN, controller="gloo", args=[*SHORT, f"run.dir={tmp_path / 'r'}"], timeout=180,
                    env={"PARLE_HVD_INJECT_SLOW_LOAD": "1:hang"}, expect_fail=True, out_dir=tmp_path / "job")
    text = out[0]["_output"]
    assert out[0]["_rc"] != 0 and "rank 1 stopped answering" in text and "loading data" in text, text
    assert "no progress for" in text
    assert "[rank 1] SIGTERM while loading data: stopped before the first outer step" in text, text
    # rank 1's own record, written after its exit handlers: it ended itself with 128+SIGTERM.
    # horovodrun SIGKILLs a rank still alive 5 s after its SIGTERM, which leaves no record.
    record = tmp_path / "job/rank1.exit"
    assert record.exists() and record.read_text() == "143", text
    assert not (tmp_path / "job/rank0.exit").exists()      # the watchdog's os._exit(4): no handlers
