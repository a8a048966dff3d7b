"""Your model, loss, metric and dataset by import path (parle_hvd/targets.py): defined outside
the package (tests/user_code: a module on PYTHONPATH, and a file by path), trained on 2
ranks through train.py and through parle_hvd.compare, the result loadable into the user's
own class with weights_only=True; and every kind of bad target refused with one line,
exit 2, before any collective and before any file is written."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from multirank import MPI_ENV, ROOT, run_ranks
from parle_hvd.targets import TargetError, load_target, load_user_dataset

USER = ROOT / "tests/user_code"
TRAIN = ROOT / "tests/ranks/train_rank.py"
ENV = {"PYTHONPATH": f"{USER}{os.pathsep}{ROOT}"}
OWN = ["model.target=usermods.nets:make_mlp", "model.kwargs={hidden: 32}", "data.target=tests/user_code/data.py:make",
       "train.loss=usermods.losses:smoothed_ce", "train.batch_size=64", "train.epochs=4", "parle.sync_period=4",
       "optim.schedule=constant", "eval.every=2", "eval.bn_batches=0", "run.progress=lines", "dist.threads=1"]


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(USER))


def test_targets_by_module_and_by_file_and_their_errors(on_path):
    from usermods.nets import make_mlp
    assert load_target("usermods.nets:make_mlp", "model.target") is make_mlp
    make = load_target("tests/user_code/data.py:make", "data.target")
    ds = load_user_dataset("tests/user_code/data.py:make", {"n_train": 100})
    assert ds.train_x.shape == (100, 8) and ds.test_y.dtype == torch.int64 and ds.val_x.shape == (256, 8)
    assert ds.mean is None and len(make()) == 3
    for spec, needle in [("usermods.nope:f", "cannot import usermods.nope (ModuleNotFoundError"),
                         ("usermods.nets", "is not module:function"),
                         ("usermods.nets:missing", "usermods.nets has no attribute 'missing'"),
                         ("usermods.nets:NOT_CALLABLE", "is a int, not callable"),
                         ("tests/user_code/none.py:f", "no such file tests/user_code/none.py")]:
        with pytest.raises(TargetError) as e:
            load_target(spec, "model.target")
        assert str(e.value).startswith("model.target: ") and needle in str(e.value), e.value


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "train.py", "--config", "configs/fashion_parle.yaml", "dist.backend=none",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})


@pytest.mark.parametrize("override,needle", [
    ("model.target=usermods.nope:make", "model.target: cannot import usermods.nope"),
    ("model.target=usermods.nets:NOT_CALLABLE", "model.target: usermods.nets:NOT_CALLABLE is a int, not callable"),
    ("model.target=usermods.nets:not_a_module", "model.target: usermods.nets:not_a_module returned a dict, not a "
                                                "torch.nn.Module"),
    ("model.target=usermods.nets:raises", "model.target: usermods.nets:raises(**model.kwargs) raised RuntimeError: "
                                          "no GPU named gpu7"),
    ("model.kwargs=[1, 2]", "model.kwargs: expected a mapping"),
    ("data.target=tests/user_code/data.py:empty", "data.target: the training set from tests/user_code/data.py:empty "
                                                  "is empty (length 0)"),
    ("data.target=tests/user_code/data.py:one_set", "must return (train, test) or (train, test, validation)"),
    ("train.loss=usermods.losses:per_example", "train.loss: usermods.losses:per_example must return a scalar tensor, "
                                               "got (2,)"),
    ("eval.metric=usermods.losses:nope", "eval.metric: usermods.losses has no attribute 'nope'"),
    ("data.val_frac=0.1", "data.val_frac: not with data.target"),
    ("model.target=", "model.name: lenet cannot take the data's inputs of shape (8,)"),
    ("model.kwargs={d: 2024-01-01}", "model.kwargs: values must be numbers, strings, booleans, lists or mappings"),
    ("eval.metric=usermods.losses:accuracy", "a function of your own may not be named accuracy"),
])
def test_bad_targets_are_one_line_exit_2_and_nothing_written(tmp_path, override, needle):
    base = [o for o in OWN if o.split("=")[0] != override.split("=")[0]]
    r = _cli(*base, override, f"run.dir={tmp_path / 'r'}")
    lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (tmp_path / "r").exists()


@pytest.mark.multirank
def test_a_bad_target_stops_every_rank_before_any_collective(tmp_path):
    out = run_ranks(TRAIN, args=["--config", "configs/fashion_parle.yaml", *OWN, "train.loss=usermods.losses:per_example",
                                 f"run.dir={tmp_path / 'r'}"], env=ENV, timeout=120, reports=False, expect_fail=True)
    o = out[0]["_output"]
    errors = [l for l in o.splitlines() if "error: train.loss: usermods.losses:per_example must return a scalar" in l]
    assert out[0]["_rc"] != 0 and len(errors) == 1, o          # rank 0's line, once; no rank waits for another
    assert "stopped answering" not in o and not (tmp_path / "r").exists()


@pytest.mark.multirank
def test_a_read_failing_on_one_rank_mid_run_is_that_ranks_line_and_no_traceback(tmp_path):
    """A streamed data.target whose reads fail on rank 1 only, mid-run: rank 1 names the
    example in an error: line; rank 0, left alone in the next collective, says so in one
    line of its own (when the launcher's SIGTERM does not end it first), not with Horovod's
    traceback."""
    out = run_ranks(TRAIN, controller="gloo", args=[
        "--config", "configs/fashion_parle.yaml", "model.target=usermods.nets:make_mlp",
        "data.target=tests/user_code/data.py:fails_on_rank1", "data.stream=true", "data.workers=0",
        "train.batch_size=32", "train.epochs=4", "parle.sync_period=4", "eval.bn_batches=0", "dist.threads=1",
        "run.tensorboard=false", f"run.dir={tmp_path / 'r'}"], env=ENV, timeout=120, reports=False, expect_fail=True)
    o = out[0]["_output"]
    assert out[0]["_rc"] != 0, o
    assert re.search(r"^\[1\](<stderr>)?:error: rank 1: data.target: reading example \d+ raised OSError: example "
                     r"\d+: Input/output error$", o, re.M), o
    assert not re.search(r"^\[0\](<stderr>)?:Traceback", o, re.M), o
    rank0 = re.findall(r"^\[0\](?:<stderr>)?:(error: .*)$", o, re.M)
    assert rank0 in ([], ["error: rank 0: the engine ended a collective this rank waited in (Horovod has been shut "
                          "down): another rank left the job or disagreed; its own error line, if it printed one, "
                          "says why"]), o


@pytest.mark.multirank
def test_own_model_loss_and_dataset_train_on_two_ranks_through_train_py_and_compare(tmp_path, on_path):
    run = tmp_path / "run"
    run_ranks(TRAIN, args=["--config", "configs/fashion_parle.yaml", *OWN, "eval.metric=usermods.losses:top2",
                           f"run.dir={run}"], env=ENV, timeout=240, reports=False)
    s = json.loads((run / "summary.json").read_text())
    assert s["world_size"] == 2 and s["metric"] == "top2" and s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    assert s["test_top2"] > 0.9 and s["valid_top2"] > 0.9 and "val_accuracy" not in s, s   # chance: 0.5
    # the shipped reference loads into the user's own class, weights only
    from usermods.nets import make_mlp
    net = make_mlp(hidden=32)
    net.load_state_dict(torch.load(run / "final.pt", weights_only=True))
    card = json.loads((run / "final.json").read_text())
    assert card["model"] == {"name": "", "target": "usermods.nets:make_mlp", "kwargs": {"hidden": 32}, "dtype": "float32"}
    assert card["input"] == {"shape": [8], "dtype": "float32", "mean": None, "std": None, "resize": None,
                             "crop_frac": None} and card["metric"] == "top2"
    from parle_hvd.targets import load_user_dataset
    ds = load_user_dataset("tests/user_code/data.py:make", {})
    acc = float((net(ds.test_x).argmax(1) == ds.test_y).float().mean())
    assert acc > 0.75, acc                                      # chance: 0.25

    # the same targets through parle_hvd.compare (accuracy, selected on the dataset's validation set)
    cmd = [sys.executable, "-m", "parle_hvd.compare", "--config", "configs/fashion_parle.yaml", "--algos",
           "parle,localsgd", "--np", "2", "--seeds", "1", "--name", "own", "--reports", str(tmp_path), *OWN]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, **MPI_ENV, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = (tmp_path / "own" / "report.md").read_text()
    assert "| parle | 2 | 1 |" in rep and "| localsgd | 2 | 1 |" in rep, rep
    got = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert all(got[a]["42"]["config"]["model"]["target"] == "usermods.nets:make_mlp" for a in ("parle", "localsgd"))
    assert all(got[a]["42"]["val_accuracy"] > 0.75 for a in ("parle", "localsgd")), got
    # a metric of the user's own has no known direction: compare refuses it (loss and
    # perplexity rank lower-is-better: test_compare_ranks_by_loss_or_perplexity below)
    r = subprocess.run(cmd + ["eval.metric=usermods.losses:top2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, **ENV})
    assert r.returncode == 2 and "eval.metric: parle_hvd.compare ranks runs by accuracy, loss or perplexity" in r.stderr


def test_compare_ranks_by_loss_or_perplexity():
    """eval.metric=loss or perplexity (a language model's): every figure is that one, lower
    is better, the time-to-target target is the highest mean final value. Runs made by hand."""
    from parle_hvd.compare import Score, report, run_figures
    sc = Score("perplexity")
    def run(seed, finals, wall):
        ms = [{"step": i + 1, "val/perplexity": v, "valid/perplexity": v + 0.5, "train/wall_seconds": w}
              for i, (v, w) in enumerate(zip(finals, wall))]
        return (seed, ms, {"test_perplexity": finals[-1], "bytes_communicated": 1e6, "wall_seconds": wall[-1],
                           "passes": 1.0, "allreduce_calls": 3})
    runs = {"parle": [run(42, [9.0, 6.0, 5.0], [1, 2, 3]), run(43, [9.5, 6.5, 5.2], [1, 2, 3])],
            "diloco": [run(42, [8.0, 7.0, 6.0], [1, 2, 3]), run(43, [8.5, 7.5, 6.4], [1, 2, 3])]}
    assert sc.default_target(runs) == pytest.approx(6.2)            # diloco's mean final: the worse one
    f = run_figures(runs["parle"][0][1], runs["parle"][0][2], 6.2, sc)
    assert (f["final"], f["chosen"], f["tta"]) == (5.0, 5.0, 2)      # first <= 6.2: 6.0 at step 2, wall 2 s
    rep = report(__import__("pathlib").Path("x"), runs, "cmd", 2, 6.2, sc)
    assert "| parle | 2 | 2 | 5.10 ± 1.27 |" in rep and "Target test perplexity for the time column: 6.2" in rep, rep
    assert "baseline minus Parle (positive: Parle's perplexity is lower)" in rep
    assert "| diloco (n=2) | 1.10 ± " in rep, rep
