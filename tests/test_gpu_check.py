"""launch/gpu_check.sh in its dry run (GPU_CHECK_DRY=1): the GPU check's every step, on the
CPU at tiny sizes, so that the script a lent GPU machine runs is known to work end to end."""
import json
import re
from pathlib import Path

import pytest

from multirank import ROOT, run_command

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = [pytest.mark.multirank, pytest.mark.horovod,     # step 4 runs horovodrun
              pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")]


def test_gpu_check_dry_run_goes_through_every_step(tmp_path):
    rc, out = run_command([str(ROOT / "launch/gpu_check.sh")], env={"GPU_CHECK_DRY": "1", "OUT": str(tmp_path)},
                          timeout=400)
    assert rc == 0, out
    for s in ("== ", "2. unit tier, device cpu", "3. samples per second", "4. 2 ranks sharing the device",
              "5. the same under torchrun", "two ranks on cpu (torch gloo)", "6. parle.overlap and parle.balance=time",
              "overlap and balance: ", "7. mixed precision and torch.compile", "8. 2 ranks under fp16",
              "9. placement with one visible device per rank"):
        assert s in out, (s, out)
    assert "1. Horovod" not in out                          # the dry run builds nothing
    thr = (tmp_path / "throughput.txt").read_text()
    algos = ("parle", "sgd", "dpsgd", "elastic", "entropy", "localsgd", "diloco")
    for a in algos:                                          # every algorithm, beside plain SGD
        assert re.search(rf"^lenet_{a}_samples_per_sec: [0-9.]+", thr, re.M), (a, thr)
        assert re.search(rf"^lenet_{a}_ratio_to_sgd: [0-9.]+", thr, re.M), (a, thr)
    for engine in ("horovod gloo", "torch gloo"):              # step 4 (horovodrun) and step 5 (torchrun)
        assert re.search(rf"two ranks on cpu \({engine}\): \d+ outer steps, \d+ allreduces \(= K \+ 1 \+ E\)", out), out
    prec = (tmp_path / "precision.txt").read_text()
    for v in ("fp32", "bf16"):
        assert re.search(rf"^lenet\.{v}\.samples_per_sec: [0-9.]+", prec, re.M), (v, prec)
    s = json.loads((tmp_path / "fp16_accum" / "summary.json").read_text())
    assert s["precision"] == "fp16" and s["accum"] == 2, s
    assert re.search(r"\d+ passed", out.split("9. placement")[1]), out
    assert (tmp_path / "gpu_check.log").is_file() and (tmp_path / "two_ranks" / "summary.json").is_file()
