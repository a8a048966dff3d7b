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
