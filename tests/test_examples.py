"""Every example in examples/ runs: the character-level language model (examples/charlm),
one short pass on 2 ranks through train.py with its own model, data and loss."""
import json
import math
import sys

import pytest
import torch

from multirank import ROOT, run_ranks

TRAIN = ROOT / "tests/ranks/train_rank.py"


@pytest.mark.multirank
def test_charlm_trains_through_train_py_and_ships_weights(tmp_path):
    run = tmp_path / "charlm"
    run_ranks(TRAIN, args=["--config", "examples/charlm/charlm.yaml", "train.epochs=0.5", "eval.every=0.25",
                           "dist.threads=1", "run.progress=lines", f"run.dir={run}"], timeout=240, reports=False)
    s = json.loads((run / "summary.json").read_text())
    assert s["metric"] == "perplexity" and s["world_size"] == 2
    assert s["allreduce_calls"] == s["outer_steps"] + 1 + s["evaluations"]
    # 103 characters: a model that learned nothing has perplexity ~103; half a pass gets well below
    assert s["test_perplexity"] < 45 and s["valid_perplexity"] < 45, s
    assert math.isclose(s["test_perplexity"], math.exp(s["test_loss"]), rel_tol=1e-9)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    ppl = [r["val/perplexity"] for r in rows if "val/perplexity" in r]
    assert len(ppl) == s["evaluations"] >= 2 and ppl[-1] < ppl[0]
    # the weights load into the example's own class, weights only
    sys.path.insert(0, str(ROOT / "examples/charlm"))
    try:
        from model import make_gpt, lm_loss
        from data import make
    finally:
        sys.path.pop(0)
    net = make_gpt()
    net.load_state_dict(torch.load(run / "final.pt", weights_only=True))
    _, test, _ = make()
    with torch.no_grad():
        loss = float(lm_loss(net.eval()(test.tensors[0]), test.tensors[1]))
    assert math.isclose(loss, s["test_loss"], rel_tol=1e-4), (loss, s["test_loss"])


OWN = ROOT / "examples/own_loop.py"


@pytest.mark.multirank
@pytest.mark.parametrize("controller", ["gloo", "torchrun"])
def test_own_loop_matches_train_py_to_the_bit(tmp_path, controller):
    """Issue 22: examples/own_loop.py, a user's script (its model, a torch DataLoader, its
    loss, its loop) with parle_hvd.optim, ends with the same reference weights as train.py
    on the same config, to the bit in float64, on 2 ranks, under Horovod and torch.distributed:
    the trainer is a consumer of the same optimizer, not a second implementation."""
    from multirank import ENGINE_OF, horovod_installed
    if ENGINE_OF[controller] == "horovod" and not horovod_installed():
        pytest.skip("Horovod not installed")
    own = tmp_path / "own.pt"
    out = run_ranks(OWN, controller=controller, args=["--dtype", "float64", "--epochs", "2", "--train-limit", "1024",
                                                      "--out", str(own)], timeout=240, reports=False)[0]["_output"]
    accs = [float(l.rsplit(" ", 1)[1]) for l in out.splitlines() if "reference test accuracy" in l]
    assert len(accs) == 2 and accs[-1] > 0.6, out           # it learned: Fashion-MNIST's chance is 0.1
    run = tmp_path / "train"
    run_ranks(TRAIN, controller=controller, timeout=240, reports=False, args=[
        "--config", "configs/fashion_parle.yaml", f"model.target={OWN}:Net", "model.dtype=float64",
        "optim.schedule=constant", "eval.bn_batches=0", "parle.sync_period=4", "train.batch_size=32",
        "train.epochs=2", "data.train_limit=1024", "data.test_limit=1000", "eval.every=1", "run.progress=lines",
        f"run.dir={run}"])
    mine, theirs = torch.load(own, weights_only=True), torch.load(run / "final.pt", weights_only=True)
    assert mine.keys() == theirs.keys() and any("running_mean" in k for k in mine)
    for k in mine:
        assert mine[k].dtype in (torch.float64, torch.int64) and torch.equal(mine[k], theirs[k]), k
    s = json.loads((run / "summary.json").read_text())
    assert s["engine"] == ENGINE_OF[controller] and s["outer_steps"] == 2 * 1024 // 32 // 4


@pytest.mark.multirank
def test_readme_use_it_from_python_runs_on_2_ranks(tmp_path):
    """README's "Use it from Python", copied as it stands, runs under horovodrun (or torchrun
    without Horovod), learns, and writes each rank's exact-resume state."""
    import re
    from multirank import DEFAULT, launcher_cmd, run_command, VENV_BIN
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Use it from Python\n.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(code.splitlines()) < 40
    (tmp_path / "my_script.py").write_text(code)
    cmd = launcher_cmd(DEFAULT, 2) + [str(VENV_BIN / "python"), "my_script.py"]
    rc, out = run_command(cmd, timeout=240, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    assert rc == 0, out
    accs = [float(m) for m in re.findall(r"reference accuracy ([0-9.]+)", out)]
    assert len(accs) == 8 and accs[-1] > 0.85 and accs[-1] > accs[0] - 0.02, out
    for r in (0, 1):
        st = torch.load(tmp_path / f"ckpt-rank{r}.pt", weights_only=True)
        assert st["opt"]["step"] == 8 * 1024 // 32 // 4 and "ref" in st["opt"]
