"""Several runs in one job, one after the other in the same processes, as a sweep driven from
Python would: ``sweep_rank.py <run 1's train.py arguments> -- <run 2's> -- ...``. Each run's
config is made as train.py makes it, then ``parle_hvd.trainer.train``; the world is joined once
(by the first run) and left once, at the end. Each run writes its own run directory, and its
summary counts its own collectives only. A run that fails ends the job (exit 1), naming it.

A run's arguments may start with ``--env KEY=VALUE`` pairs: that run's own environment, set
before it starts and put back after it ends. Only what the trainer reads while a run goes on
takes effect this way: the testing hooks ``PARLE_HVD_INJECT_*``, ``PARLE_HVD_DUMP_*``,
``PARLE_HVD_FAKE_STEP_SECONDS``, ``PARLE_HVD_CKPT_DELAY``. Not the engine or the launcher's
variables (the world is joined once, by the first run), not what only train_rank.py reads
(``PARLE_TEST_RANK1_*``), and not inside DataLoader workers started from a fork server
(which keep the server's environment)."""
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


HOOKS = ("PARLE_HVD_INJECT_", "PARLE_HVD_DUMP_", "PARLE_HVD_FAKE_STEP_SECONDS", "PARLE_HVD_CKPT_DELAY")


def own_env(argv: list) -> tuple:
    """(the ``--env KEY=VALUE`` pairs at the start of argv as a dict, the rest); a key that
    would not take effect in a sweep is refused."""
    env = {}
    while argv and argv[0] == "--env":
        key, _, value = argv[1].partition("=")
        if not key.startswith(HOOKS):
            raise SystemExit(f"sweep_rank.py: --env {key}: only the trainer's testing hooks {HOOKS} take effect "
                             "per run; launch such a run on its own")
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
