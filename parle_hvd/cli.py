"""Command line: ``python train.py --config configs/x.yaml [key.sub=value ...]``.

Bad input (config, data, run directory) ends with one line on rank 0 and exit code 2."""
from __future__ import annotations

import argparse
import os
import signal
import sys

USAGE = """train.py [--config FILE] [--resume] [--elastic] [key.sub=value ...]

Launch:
  horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
  torchrun --nproc-per-node 2 train.py --config configs/fashion_parle.yaml  # torch.distributed
  mpirun -np 4 -H node1:2,node2:2 python train.py --config configs/fashion_parle.yaml parle.sync_period=50
  python train.py --config configs/fashion_parle.yaml train.epochs=1      # one process
  PARLE_HVD_HOSTS_FILE=hosts.txt NP=4 MIN_NP=2 MAX_NP=8 launch/elastic.sh  # ranks may leave and join"""


def _let_rank0_speak(seconds: float = 3.0) -> None:
    """A rank other than 0 that fails with the error every rank has (a bad config, say)
    leaves printing it to rank 0; it waits a moment before exiting, or the launcher, which
    ends the job at the first non-zero exit, could kill rank 0 before its line is out.

    A SIGTERM ends the wait at once: the launcher sends it when a rank has exited (rank 0,
    its line out), and a job being stopped has nothing to wait for. (The run's own SIGTERM
    handler, which train.py keeps, would only note a stop request and sleep on.)"""
    import time
    ended = []
    try:
        before = signal.signal(signal.SIGTERM, lambda signum, frame: ended.append(signum))
    except ValueError:            # not the main thread: a plain wait
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    try:
        while not ended and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
    finally:                      # (None: a handler set outside Python, which cannot be put back)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def exit_now(rc) -> None:
    """End the process with exit status ``rc`` the way Python would, less its last second.

    A process that imported torch, Dynamo and Horovod spends about 1 s after its last line
    (here: 0.8-1.1 s of one core) freeing those modules' objects one by one, which nothing
    needs once the run is over. So: the steps of Python's own exit that matter (waiting for
    non-daemon threads, the exit handlers: logging, multiprocessing's and the DataLoader
    workers', Horovod's; flushing stdout and stderr), then ``os._exit``. Every file the run
    wrote was closed by then (logger, checkpoints, summary)."""
    import atexit
    import threading
    shutdown = getattr(threading, "_shutdown", None)    # what Python's exit calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc if isinstance(rc, int) else (0 if rc is None else 1))


def _rank_from_env() -> int:
    # (PMI_RANK before SLURM_PROCID: under mpiexec inside an allocation the ranks inherit the
    # proxies' SLURM_PROCID; under srun --mpi=pmi2 the two agree)
    for k in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
              "PMIX_RANK"):
        if k in os.environ:
            try:
                return int(os.environ[k])
            except ValueError:
                pass
    return 0


def main(argv=None) -> int:
    from .config import ConfigError, help_text, make_config

    ap = argparse.ArgumentParser(prog="train.py", usage=USAGE, add_help=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", action="store_true", help="same as run.resume=true")
    ap.add_argument("--elastic", action="store_true", help="same as dist.elastic=true")
    ap.add_argument("-h", "--help", action="store_true")
    ap.add_argument("overrides", nargs="*")
    def one_line_error(message: str):
        print(f"error: {message} (train.py --help for usage)", file=sys.stderr, flush=True)
        sys.exit(2)
    ap.error = one_line_error
    args = ap.parse_intermixed_args(argv)     # flags may come after key=value overrides
    if args.help:
        print(f"usage: {USAGE}\n\nConfiguration keys (YAML sections, or key.sub=value on the command line):\n"
              f"{help_text()}")
        return 0
    rank = _rank_from_env()
    if hasattr(signal, "SIGXFSZ"):
        # a file-size limit makes writes fail with EFBIG (reported below) instead of killing us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    overrides = (list(args.overrides) + (["run.resume=true"] if args.resume else [])
                 + (["dist.elastic=true"] if args.elastic else []))
    try:
        # the config is checked before torch is imported (1-3 s): a typo costs a tenth of a second
        cfg = make_config(args.config, overrides)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            _let_rank0_speak()
        return 2
    from .checkpoint import CheckpointError
    from .data import DataError
    from .trainer import DivergenceError, RunError, train
    from .watchdog import Interrupted
    try:
        train(cfg, give_back_signals=False)
    except (ConfigError, DataError, RunError, CheckpointError) as e:
        if rank == 0 or isinstance(e, CheckpointError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            _let_rank0_speak()
        return 2
    except DivergenceError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            _let_rank0_speak()
        return 3
    except OSError as e:      # a full disk or a vanished directory while writing logs
        print(f"error: rank {rank}: {e.strerror or e}: {e.filename or ''}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as e:
        print(f"[rank {rank}] {e}: stopped before the first outer step (nothing trained, no checkpoint to write)",
              file=sys.stderr, flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"[rank {rank}] interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        from . import comm
        if not comm.peer_left(e):
            raise
        # mostly another rank that ended with its own line (an unreadable example, stuck
        # workers): Horovod's traceback here would bury it; Horovod's first words stay
        why = (str(e).split(". ")[0].splitlines() or [type(e).__name__])[0][:160]
        print(f"error: rank {rank}: the engine ended a collective this rank waited in ({why}): another rank left "
              f"the job or disagreed; its own error line, if it printed one, says why", file=sys.stderr, flush=True)
        return 4
    finally:
        from . import comm
        comm.shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main())
