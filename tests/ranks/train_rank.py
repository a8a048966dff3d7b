"""Run the real CLI on each rank; rank 1 may get extra overrides (PARLE_TEST_RANK1_OVERRIDES,
space-separated) to prove that rank 0's values win, or a file-size limit
(PARLE_TEST_RANK1_FSIZE, bytes) to make its checkpoint writes fail."""
import os
import sys

from parle_hvd.cli import _rank_from_env, exit_now, main


def run() -> int:
    args = sys.argv[1:]
    if _rank_from_env() == 1 and os.environ.get("PARLE_TEST_RANK1_OVERRIDES"):
        args += os.environ["PARLE_TEST_RANK1_OVERRIDES"].split()
    if _rank_from_env() == 1 and os.environ.get("PARLE_TEST_RANK1_FSIZE"):
        # a full disk on rank 1 only: its files may not grow beyond this many bytes
        import resource
        n = int(os.environ["PARLE_TEST_RANK1_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return main(args)


if __name__ == "__main__":      # forkserver's DataLoader workers import this file again
    exit_now(run())               # as train.py ends
