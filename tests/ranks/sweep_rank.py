"""Several runs in one job, one after the other in the same processes, as a sweep driven from
Python would: ``sweep_rank.py <run 1's train.py arguments> -- <run 2's> -- ...``. Each run's
config is made as train.py makes it, then ``parle_hvd.trainer.train``; the world is joined once
(by the first run) and left once, at the end. Each run writes its own run directory, and its
summary counts its own collectives only. A run that fails ends the job (exit 1), naming it.

A run's arguments may start with ``--env KEY=VALUE`` pairs: that run's own environment
(``PARLE_HVD_INJECT_STOP=1:8``, say), set before it starts and removed after it ends, as if
it had been launched alone with them."""
import os
import sys

from parle_hvd import comm
from parle_hvd.cli import exit_now
from parle_hvd.config import make_config
from parle_hvd.trainer import train


def runs(argv: list) -> list:
    out, cur = [], []
    for a in argv:
        if a == "--":
            out.append(cur)
            cur = []
        else:
            cur.append(a)
    return out + [cur]


def own_env(argv: list) -> tuple:
    """(the ``--env KEY=VALUE`` pairs at the start of argv as a dict, the rest)."""
    env = {}
    while argv and argv[0] == "--env":
        key, _, value = argv[1].partition("=")
        env[key] = value
        argv = argv[2:]
    return env, argv


def run() -> int:
    for i, argv in enumerate(runs(sys.argv[1:])):
        env, argv = own_env(argv)
        assert argv[0] == "--config", argv
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            train(make_config(argv[1], argv[2:]))
        except BaseException as e:        # every rank names the run it failed in, then the job ends
            print(f"[rank {comm.rank()}] sweep run {i} ({' '.join(argv[2:])}) failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            raise
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    comm.shutdown()
    return 0


if __name__ == "__main__":
    exit_now(run())
