import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# launch/gpu_check.sh runs the unit tier with PARLE_HVD_TEST_DEVICE=cuda: tensors the tests
# create land on that device unless they say otherwise (the trainer's dist.device=auto
# picks the GPU by itself).
if os.environ.get("PARLE_HVD_TEST_DEVICE", "cpu") != "cpu":
    import torch
    torch.set_default_device(os.environ["PARLE_HVD_TEST_DEVICE"])


# A setup without Horovod (PARLE_HVD_ENGINE=torch make setup) runs everything but the tests
# marked `horovod`, and names each one it skipped at the end of the run.
import importlib.util

import pytest

HOROVOD = importlib.util.find_spec("horovod") is not None
_skipped_horovod: list = []


@pytest.hookimpl(trylast=True)          # after -k/-m deselection: name only what would have run
def pytest_collection_modifyitems(config, items):
    if HOROVOD:
        return
    skip = pytest.mark.skip(reason="Horovod-only: Horovod is not installed (PARLE_HVD_ENGINE=torch setup)")
    for item in items:
        if item.get_closest_marker("horovod"):
            item.add_marker(skip)
            _skipped_horovod.append(item.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _skipped_horovod:
        terminalreporter.write_sep("=", f"{len(_skipped_horovod)} Horovod-only tests skipped (Horovod not installed)")
        for nodeid in _skipped_horovod:
            terminalreporter.write_line(nodeid)
