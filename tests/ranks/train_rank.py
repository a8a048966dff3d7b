"""Run the real CLI on each rank; rank 1 may get extra overrides (PARLE_TEST_RANK1_OVERRIDES,
space-separated) to prove that rank 0's values win."""
import os
import sys

from parle_hvd.cli import _rank_from_env, main

args = sys.argv[1:]
if _rank_from_env() == 1 and os.environ.get("PARLE_TEST_RANK1_OVERRIDES"):
    args += os.environ["PARLE_TEST_RANK1_OVERRIDES"].split()
sys.exit(main(args))
