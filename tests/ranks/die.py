"""Rank 1 kills itself with SIGKILL (argv[1] == "kill") or stops answering (argv[1] ==
"hang") before a collective; rank 0 waits in the allreduce."""
import os
import signal
import sys
import time

import torch

from parle_hvd import comm

comm.init()
r = comm.rank()
print(f"rank {r} of {comm.size()} alive pid {os.getpid()}", flush=True)
if r == 1:
    if sys.argv[1] == "hang":
        print("rank 1 about to hang", flush=True)
        time.sleep(3600)
    print("rank 1 about to die", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
print(f"rank {r} entering allreduce", flush=True)
comm.allreduce_mean_([torch.ones(4)])   # all ranks reach this (except the dead one)
print(f"rank {r} unexpectedly finished", flush=True)
