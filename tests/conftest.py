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
