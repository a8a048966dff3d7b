"""Run the real CLI on each rank; rank 1 may get extra overrides (PARLE_TEST_RANK1_OVERRIDES,
space-separated) to prove that rank 0's values win, or a file-size limit
(PARLE_TEST_RANK1_FSIZE, bytes) to make its checkpoint writes fail.

A rank whose ``main`` returns writes ``$PARLE_TEST_OUT/rank<r>.exit``, its exit status, once
every exit handler has run (Horovod's shutdown, the DataLoader workers' and
multiprocessing's), just before ``os._exit``: the rank's own account of how it ended. A rank
that ends any other way (the watchdog's ``os._exit(4)``, an uncaught exception, a SIGKILL)
writes none. Tests read this record, not horovodrun's "Process N exit with status code"
line: horovodrun's middleman SIGSTOPs and SIGTERMs the ``sh -c`` around a rank it
terminates, and that shell sometimes reports 0 for a rank that called ``os._exit(143)``
(seen 1 run in 5-7 with two busy cores beside the job)."""
import atexit
import os
import sys
from pathlib import Path

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


def _record_exit(rc: list) -> None:
    if rc and os.environ.get("PARLE_TEST_OUT"):
        Path(os.environ["PARLE_TEST_OUT"], f"rank{_rank_from_env()}.exit").write_text(str(rc[0]))


if __name__ == "__main__":      # forkserver's DataLoader workers import this file again
    status: list = []
    atexit.register(_record_exit, status)   # registered first, so it runs last
    status.append(run())
    exit_now(status[0])           # as train.py ends
