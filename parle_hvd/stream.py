"""Streamed data: examples decoded in DataLoader worker processes, a bounded memory per
rank whatever the size of the dataset.

    python train.py --config ... data.name=folder data.dir=/data/imagenet data.image_size=224 \
        data.augment=imagenet data.workers=8 model.name=resnet18
    python train.py --config ... data.name=shards data.dir=/data/imagenet-shards data.workers=8
    python train.py --config ... data.target=mypkg.data:make data.stream=true data.workers=4

``data.stream=auto`` streams when the decoded training set would exceed
``data.memory_limit`` GiB per rank, for tar shards, and for the ImageNet recipe (which
crops the original image, so nothing decoded can be kept); the in-memory path (data.py)
stays for the datasets that fit. What a rank holds is the list of its examples (a path,
or a shard's offset, and a label, per example), the workers' prefetched batches, and for
shards ``data.shuffle_shards`` shards' bytes at a time.

The sampling guarantees are those of the in-memory path, because the order is made by the
same samplers in the main process: the DataLoader only decodes (``batch_sampler`` is the
replica's stream of index batches). Each Parle replica has its own order; dpsgd's ranks get
disjoint windows (of examples, or of shards); everything is fixed by ``train.seed``. A
streamed folder without the ImageNet recipe gives the same batches, to the bit, as the
same folder held in memory (the same decoder, ``data.decode_image``).

Exact resume: the checkpoint holds the sampler's position (batches taken by the trainer,
not those prefetched) and the augmentation stream's state; a streamed example's random
crop is drawn from a ``random.Random`` seeded by (seed, replica, pass, position in the
pass), so it does not depend on which worker decodes it, nor on how many there are, nor
on a restart. A resumed run restarts its workers at the saved position.

Tar shards (shards.py): pass ``e`` of replica ``a`` visits its window of shards in the order
``randperm(seed, a, e)``, ``data.shuffle_shards`` shards at a time; the examples of such a
group come in one random order, and the batches are cut from the pass's sequence. A shard
is read whole, sequentially, in the main process (a thread reads the next group ahead), and
the workers decode its bytes.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import math
import multiprocessing
import os
import pickle
import random
import signal
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from . import data as D
from .data import DataError, augment_batch, decode_image, seed_of
from .targets import file_modules, import_file_modules

GiB = 1 << 30


# --------------------------------------------------------------------------- tables of examples
class Strings:
    """A sequence of str in two numpy buffers (the bytes, and where each one starts)
    instead of a list of Python objects. A forked worker that reads an item of a list writes
    that object's reference count, which copies the page it lies on: over a pass each worker
    of each rank would end up with its own copy of a 1.28 M-path list (pytorch/pytorch#13246).
    These pages are only ever read."""

    def __init__(self, items=()):
        b = [str(x).encode("utf-8", "surrogateescape") for x in items]
        self.off = np.zeros(len(b) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, b), dtype=np.int64, count=len(b)), out=self.off[1:])
        self.buf = np.frombuffer(b"".join(b), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.off) - 1

    def __getitem__(self, i: int) -> str:
        return self.buf[self.off[i]:self.off[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def take(self, idx) -> "Strings":
        return Strings(self[i] for i in idx)


@dataclass
class Table:
    """The examples of one split, none of them decoded: ``files`` (a path each), ``shards``
    (shard number, offset, size: one image's bytes in a tar), or ``target`` (an index into
    the user's Dataset). ``refs`` and ``names`` are packed (``Strings``, int64 arrays), not
    lists, so that the workers share their pages with the rank."""
    kind: str
    refs: object
    labels: Optional[torch.Tensor]
    shards: list = field(default_factory=list)
    ds: object = None
    names: Optional[Strings] = None

    def __post_init__(self):
        if self.kind == "files" and not isinstance(self.refs, Strings):
            self.refs = Strings(self.refs)
        elif self.kind != "files" and not isinstance(self.refs, np.ndarray):
            self.refs = np.asarray(self.refs, dtype=np.int64).reshape((-1, 3) if self.kind == "shards" else (-1,))
        if self.names is not None and not isinstance(self.names, Strings):
            self.names = Strings(self.names)

    def __len__(self) -> int:
        return len(self.refs)

    def subset(self, idx) -> "Table":
        idx = [int(i) for i in idx]
        refs = self.refs.take(idx) if self.kind == "files" else self.refs[np.asarray(idx, dtype=np.int64)]
        return Table(self.kind, refs, None if self.labels is None else self.labels[idx],
                     self.shards, self.ds, None if self.names is None else self.names.take(idx))

    def shard_row(self, i: int) -> tuple:
        s, off, size = self.refs[i].tolist()
        return s, off, size

    def name(self, i: int) -> str:
        if self.kind == "files":
            return self.refs[i]
        if self.kind == "shards":
            s, off, _ = self.shard_row(i)
            return f"{self.shards[s]}:{self.names[i] if self.names is not None else off}"
        return f"example {int(self.refs[i])}"

    def read(self, i: int):
        """An image's source: its path, or its bytes read from the shard."""
        if self.kind == "files":
            return self.refs[i]
        s, off, size = self.shard_row(i)
        try:
            with open(self.shards[s], "rb") as f:
                f.seek(off)
                b = f.read(size)
        except OSError as e:
            raise DataError(f"{self.shards[s]}: cannot read ({e.strerror or e})") from None
        if len(b) != size:
            raise DataError(f"{self.name(i)}: truncated shard (wanted {size} bytes at offset {off})")
        return b


@dataclass
class StreamedData:
    """What the trainer needs of a streamed dataset; the in-memory ``data.Dataset``'s
    counterpart (``streamed`` tells them apart)."""
    name: str
    train: Table
    test: Table
    val: Optional[Table]
    num_classes: int
    mean: Optional[tuple]
    std: Optional[tuple]
    shape: tuple
    input_dtype: str = "uint8"
    recipe: str = "fixed"          # fixed (squash to size) or imagenet (random-resized crop / center crop)
    size: int = 0
    gray: bool = False
    crop_frac: float = 0.875
    workers: int = 0
    prefetch: int = 2
    pin: bool = False
    context: str = "fork"
    stall: float = 0.0             # seconds a rank waits for one batch from live workers (0: forever)
    skip_corrupt: bool = False
    shuffle_shards: int = 4
    streamed = True

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def train_y(self):
        return self.train.labels


# --------------------------------------------------------------------------- decoding (in the workers)
class _seeded:
    """A user's ``__getitem__`` may draw from torch's (CPU), NumPy's or Python's global
    generator (a random transform): each is seeded by the example's own seed (seed,
    replica, pass, position), as our crops are, so that the draws do not depend on the
    worker that decodes the example or on the number of workers, and a resume replays
    them. In the training process itself (data.workers=0), whose dropout and noise draw
    from torch's generator, the three states are put back after; a worker's need not be.
    GPU generators are not touched (a DataLoader worker does not use the GPU)."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        main = torch.utils.data.get_worker_info() is None
        self.saved = (torch.get_rng_state(), np.random.get_state(), random.getstate()) if main else None
        torch.default_generator.manual_seed(self.seed)
        np.random.seed(self.seed % 2**32)
        random.seed(self.seed)

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.set_rng_state(self.saved[0])
            np.random.set_state(self.saved[1])
            random.setstate(self.saved[2])
        return False


class _Files:
    """Unpickled as the import of the files another process imported by path
    (data.target=path/to/file.py:fn): before what follows it in the same pickle."""

    def __init__(self, files: dict):
        self.files = files

    def __reduce__(self):
        return import_file_modules, (self.files,)


class Decoder(torch.utils.data.Dataset):
    """Decodes a batch of ``(index, seed, bytes or None)`` items of ``table`` into
    ``{"x": uint8 [B, C, H, W] (or the user's inputs), "y": [B], "skipped": [...],
    "error": None or one line}``. A worker never raises: an error travels as a line, which
    the main process raises as a DataError (one line, not a worker's traceback)."""

    def __init__(self, d: StreamedData, table: Table, mode: str):
        self.d, self.t, self.mode = d, table, mode

    def __getstate__(self) -> dict:
        # what a forkserver or spawn worker is sent: its own table and the options, not
        # every split's (a million training paths sent to each worker of each evaluation);
        # first (a dict unpickles in order), the files imported by path, which a user's
        # dataset class may live in
        return {"files": _Files(file_modules()), **self.__dict__,
                "d": dataclasses.replace(self.d, train=None, test=None, val=None)}

    def __setstate__(self, state: dict) -> None:
        state.pop("files", None)
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.t)

    def _image(self, i: int, seed: int, blob):
        d = self.d
        recipe = "fixed" if d.recipe == "fixed" else self.mode
        rng = random.Random(seed) if recipe == "train" else None
        return torch.from_numpy(decode_image(self.t.read(i) if blob is None else blob, size=d.size, gray=d.gray,
                                             recipe=recipe, rng=rng, crop_frac=d.crop_frac, name=self.t.name(i)))

    def _one(self, i: int, seed: int, blob, skipped: list):
        if self.t.kind == "target":
            try:
                with _seeded(seed):
                    x, y = self.t.ds[int(self.t.refs[i])]
            except Exception as e:       # the user's __getitem__: one line naming it
                raise DataError(f"data.target: reading example {int(self.t.refs[i])} raised {type(e).__name__}: {e}") from None
            return torch.as_tensor(x), torch.as_tensor(y)
        n = len(self.t)
        for tried in range(n):
            j = (i + tried) % n          # a corrupt image's place goes to the next readable one
            try:
                return self._image(j, seed, blob if tried == 0 else None), self.t.labels[j]
            except DataError as e:
                if not self.d.skip_corrupt:
                    raise
                skipped.append(str(e))
        raise DataError(f"data.skip_corrupt: every one of the {n} images is unreadable")

    def __getitems__(self, items: list) -> dict:
        skipped: list = []
        try:
            xs, ys = zip(*(self._one(*it, skipped) for it in items))
            return {"x": torch.stack(xs), "y": torch.stack(ys), "skipped": skipped, "error": None}
        except DataError as e:
            return {"x": None, "y": None, "skipped": skipped, "error": str(e)}
        except RuntimeError as e:        # torch.stack of examples of different shapes
            return {"x": None, "y": None, "skipped": skipped,
                    "error": f"data: examples of one batch differ in shape ({e})"}
        except Exception as e:           # anything else (a user's label type, MemoryError): one line too
            return {"x": None, "y": None, "skipped": skipped,
                    "error": f"data: decoding a batch raised {type(e).__name__}: {e}".splitlines()[0]}


def _identity(batch):
    return batch


WORKER_GRACE = 120.0   # seconds a worker goes on decoding after a SIGTERM
# What asks a worker for its Python stacks: SIGURG, whose default is to be ignored, so that
# a worker not yet in _worker_init (stuck unpickling its dataset) is not killed by it, and
# which nothing here sends otherwise (SIGUSR1 may be a scheduler's warning; SIGWINCH comes
# with every resize of a terminal).
STACK_SIGNAL = signal.SIGURG


def _worker_init(_: int) -> None:
    """A worker outlives a SIGTERM by ``WORKER_GRACE`` s: SLURM and the launchers signal
    the whole process group, and the rank, which stops after its outer step with a
    checkpoint (watchdog.StopSignal), still needs its batches until then; a worker that died
    of the signal first would fail the rank's next batch instead. The alarm is a backstop:
    the rank ends its workers itself (``_end_workers``, ``StreamFeed.close``)."""
    # SIGALRM's default ends the worker; a forked one inherits its rank's handler (a test
    # runner's timeout, say), which would not.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, lambda *_: signal.alarm(int(WORKER_GRACE)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a rank that waited too long for a batch asks its workers where they are (_Batched._stuck)
    faulthandler.register(STACK_SIGNAL, all_threads=True)


_LIVE: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _end_workers() -> None:
    """Before multiprocessing's own exit handler (atexit runs newest first), which sends the
    workers SIGTERM and joins them: a worker still alive then would hold the exit for its
    grace period."""
    for it in list(_LIVE):
        it._shutdown_workers()


class _Iter(torch.utils.data.dataloader._MultiProcessingDataLoaderIter):
    """torch's worker iterator, whose wait for a batch ends after the data's ``stall``
    seconds (0: never) with the RuntimeError of torch's own ``timeout``, while it still asks
    every 5 s whether the workers live. torch's ``timeout`` asks only once it has passed, and
    a fork server's workers are not this process's children, whose death SIGCHLD would
    report at once."""

    def _get_data(self):
        stall, start = self._dataset.d.stall, time.monotonic()      # (the Decoder's StreamedData)
        while True:
            if self._pin_memory and not self._pin_memory_thread.is_alive():
                raise RuntimeError("Pin memory thread exited unexpectedly")
            left = stall - (time.monotonic() - start) if stall > 0 else math.inf
            if left <= 0:
                raise RuntimeError(f"DataLoader timed out after {stall:.0f} seconds")
            ok, data = self._try_get_data(min(torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL, left))
            if ok:
                return data


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader whose worker iterators are ended at interpreter exit (``_end_workers``)
    and stop waiting for a stuck worker after the data's ``stall`` seconds (``_Iter``)."""

    def _get_iterator(self):
        if not self.num_workers:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        it = _Iter(self)
        _LIVE.add(it)
        return it


class _Batches:
    """A ``batch_sampler`` made from a generator function (DataLoader calls ``iter`` on it)."""

    def __init__(self, fn):
        self.fn = fn

    def __iter__(self):
        return self.fn()


def worker_start(want: str) -> str:
    """``data.worker_start=auto``: forkserver in a process that has joined a world (any
    engine), fork in a single process. Joining starts the engine's threads (Horovod's
    background loop and Gloo's I/O threads, MPI's progress engine, torch.distributed's
    store). A fork copies whatever locks they hold at that instant into a child that has
    none of those threads to release them, so a worker can deadlock. (A hang seen once in
    CI fits this: a rank under horovodrun --gloo, its forked workers alive, waited for its
    first batch until the job's timeout. 16 000 forks beside Horovod's threads here did not
    reproduce it, so the cause is not proven.) A fork after MPI_Init is also unsafe with
    InfiniBand verbs (Open MPI warns of it; Horovod's examples use forkserver). The fork
    server starts from a clean exec, and its workers fork from it, single-threaded. fork
    stays the choice where no engine runs: the fastest start, and the dataset need not
    pickle. (Asked when the workers start: after comm.init.)"""
    if want != "auto":
        return want
    from . import comm                   # a question, not a collective
    return "fork" if comm.controller() == "none" else "forkserver"


def loader(d: StreamedData, table: Table, mode: str, batches) -> torch.utils.data.DataLoader:
    """A DataLoader decoding ``batches`` (an iterable of item lists) of ``table``.
    ``generator``: its own, so that starting workers draws nothing from the global stream
    (the replica's dropout and Langevin noise draw from it)."""
    kw = dict(num_workers=d.workers, collate_fn=_identity, pin_memory=d.pin, generator=torch.Generator())
    if d.workers:
        ctx = worker_start(d.context)
        if ctx == "forkserver":
            # the server imports torch and the decoders once; each worker forks from it
            multiprocessing.set_forkserver_preload(["parle_hvd.stream"])
        kw.update(prefetch_factor=d.prefetch, multiprocessing_context=ctx, worker_init_fn=_worker_init)
    return _Loader(Decoder(d, table, mode), batch_sampler=batches, **kw)


_WARNED: set = set()


class _Batched:
    """A loader's batches, with the loader's own failures as one DataError line instead of
    a traceback: a worker killed (the out-of-memory killer, a signal), a dataset that
    cannot be sent to a worker (data.worker_start=spawn or forkserver pickle it), or no
    batch from live workers for ``StreamedData.stall`` seconds (a worker stuck in a
    dataset's ``__getitem__``, on a file system, or deadlocked): their Python stacks are
    printed first, so that the line comes with where they are."""

    def __init__(self, dl, where: str):
        self.dl, self.where, self.it = dl, where, None

    def _stuck(self) -> DataError:
        it, stall = self.it, self.dl.dataset.d.stall
        workers = getattr(it, "_workers", [])
        dead = [w for w in workers if not w.is_alive()]
        if dead:      # one died in the wait's last seconds: that is the news, not a stuck one
            return DataError(f"data.workers ({self.where}): DataLoader worker (pid(s) "
                             f"{', '.join(str(w.pid) for w in dead)}) exited unexpectedly")
        live = list(workers)
        # Off torch's SIGCHLD watch first (as the loader's own shutdown does before it kills a
        # worker): their deaths below are ours, and would be raised in place of the line.
        try:
            from torch.utils.data._utils import signal_handling
            if it._worker_pids_set:
                signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
            unwatched = True
        except AttributeError:                      # another torch's internals: no kill below
            unwatched = False
        print(f"[{self.where}] no batch from the DataLoader workers in {stall:.0f} s; their stacks:",
              file=sys.stderr, flush=True)
        for w in live:
            with contextlib.suppress(OSError):
                os.kill(w.pid, STACK_SIGNAL)        # faulthandler's dump, to the rank's stderr (_worker_init)
        time.sleep(1.0)                             # let the dumps get out before the line and the exit
        if unwatched:
            # a stuck worker would outlive the SIGTERM of the loader's shutdown by its grace
            # period (_worker_init), and hold the rank's exit that long
            for w in live:
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGKILL)
        err = DataError(f"data.workers ({self.where}): no batch in {stall:.0f} s (the limit dist.timeout "
                        f"sets) from {len(live)} live worker process(es) "
                        f"(pid {', '.join(str(w.pid) for w in live)}): one is stuck, and the stacks of those that "
                        f"had started are above; raise dist.timeout if a batch is only this slow")
        err.own = True                              # this rank's alone: every rank prints it (Trainer.run)
        return err

    def _fail(self, e: Exception):
        msg = str(e)
        if isinstance(e, RuntimeError) and msg.startswith("DataLoader timed out after"):
            return self._stuck()
        if isinstance(e, RuntimeError) and "DataLoader worker" in msg:
            return DataError(f"data.workers ({self.where}): {msg}".splitlines()[0])
        if isinstance(e, pickle.PicklingError) or (isinstance(e, (AttributeError, TypeError)) and "pickle" in msg):
            return DataError(f"data.worker_start: the dataset cannot be sent to a worker process "
                             f"({type(e).__name__}: {msg}); make it picklable or use data.worker_start=fork"
                             .splitlines()[0])
        return None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            if self.it is None:
                self.it = iter(self.dl)          # starts the workers (and pickles the dataset for them)
            return next(self.it)
        except (RuntimeError, AttributeError, TypeError, pickle.PicklingError) as e:
            err = self._fail(e)
            if err is None:
                raise
            raise err from None

    def close(self) -> None:
        if self.it is not None and hasattr(self.it, "_shutdown_workers"):
            self.it._shutdown_workers()         # now, not at interpreter exit


def _check(batch: dict, where: str) -> dict:
    """A worker's error raised here, as one line; a skipped file warned about once per process
    (the feed counts every skip: summary.json's data_corrupt_skipped)."""
    if batch["error"] is not None:
        raise DataError(batch["error"])
    for msg in batch["skipped"]:
        if msg not in _WARNED:
            _WARNED.add(msg)
            print(f"warning: data.skip_corrupt: {msg}; replaced by the next readable image ({where})",
                  file=sys.stderr, flush=True)
    return batch


def eval_batches(ds, which: str, lo: int, hi: int, batch_size: int):
    """``(x, y)`` batches of examples ``lo:hi`` of the test or validation split (in memory
    or streamed: the same tensors)."""
    if not getattr(ds, "streamed", False):
        x_all, y_all = (ds.test_x, ds.test_y) if which == "test" else (ds.val_x, ds.val_y)
        for i in range(lo, hi, batch_size):
            yield x_all[i:min(i + batch_size, hi)], y_all[i:min(i + batch_size, hi)]
        return
    table = ds.test if which == "test" else ds.val
    # a target's random transform, if any, draws the same for an example at every evaluation
    spans = [[(i, seed_of(which, i), None) for i in range(a, min(a + batch_size, hi))]
             for a in range(lo, hi, batch_size)]
    batched = _Batched(loader(ds, table, "eval", spans), which)
    try:
        for b in batched:
            b = _check(b, which)
            yield b["x"], b["y"]
    finally:
        batched.close()                  # a caller that stops early ends the workers now


def train_examples(ds, batches: list):
    """Un-augmented training examples at the given index batches (BatchNorm re-estimation,
    a target's trial): in memory, or decoded with the evaluation transform."""
    if not getattr(ds, "streamed", False):
        for idx in batches:
            yield ds.train_x[idx], ds.train_y[idx]
        return
    batched = _Batched(loader(ds, ds.train, "eval", [[(int(i), seed_of("train-eval", int(i)), None) for i in idx]
                                                    for idx in batches]), "train")
    try:
        for b in batched:
            b = _check(b, "train")
            yield b["x"], b["y"]
    finally:
        batched.close()


# --------------------------------------------------------------------------- shards' order
class ShardSampler:
    """A replica's stream of batches over tar shards. Pass ``e``: the window's shards in the
    order ``randperm(seed, replica, e)``, taken ``group`` at a time; a group's examples in
    one random order; ``nb`` batches of ``batch_size`` cut from the pass's sequence (the
    rest dropped, as ReplicaSampler drops a partial batch). State is ``(pass, position)``."""

    def __init__(self, per_shard: dict, window: list, batch_size: int, *, seed: int, rank: int, nb: int, group: int):
        self.per_shard, self.window = per_shard, [int(s) for s in window]
        self.batch_size, self.seed, self.rank, self.group = batch_size, seed, rank, max(1, group)
        total = sum(len(per_shard[s]) for s in self.window)
        if batch_size > total or nb == 0:
            raise DataError(f"train.batch_size {batch_size} is larger than a replica's data ({total} examples "
                            f"in {len(self.window)} shards)")
        self.nb = min(nb, total // batch_size)
        self.epoch, self.pos = 0, 0

    def plan(self, epoch: int) -> tuple:
        """``(groups, order)``: the pass's groups of shard numbers, and its sequence of
        example indices with, beside it, the group each example comes from."""
        perm = torch.randperm(len(self.window), generator=D._gen("shard-order", self.seed, self.rank, epoch)).tolist()
        shards = [self.window[i] for i in perm]
        groups = [shards[i:i + self.group] for i in range(0, len(shards), self.group)]
        order, gid = [], []
        for g, members in enumerate(groups):
            ex = torch.cat([self.per_shard[s] for s in members])
            ex = ex[torch.randperm(len(ex), generator=D._gen("shard-mix", self.seed, self.rank, epoch, g))]
            order.append(ex)
            gid.append(torch.full((len(ex),), g, dtype=torch.int64))
        return groups, torch.cat(order), torch.cat(gid)

    def batches_from(self, epoch: int, pos: int):
        """``(epoch, pos, indices, groups, group of each)`` from position ``(epoch, pos)``."""
        B = self.batch_size
        while True:
            if pos >= self.nb:
                epoch, pos = epoch + 1, 0
            groups, order, gid = self.plan(epoch)
            while pos < self.nb:
                sl = slice(pos * B, (pos + 1) * B)
                yield epoch, pos, order[sl], groups, gid[sl]
                pos += 1

    def advance(self) -> None:
        if self.pos >= self.nb:
            self.epoch, self.pos = self.epoch + 1, 0
        self.pos += 1

    def __len__(self) -> int:
        return self.nb

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def shard_windows(d: StreamedData, *, world: int, split: str, frac: float, seed: int) -> tuple:
    """Every replica's window of training shards (the in-memory path's windows, over
    shards: ``frac = 1/n`` gives disjoint sets of shards), the examples of each shard,
    and the batches per pass common to every replica."""
    t = d.train
    col = t.refs[:, 0]
    order = np.argsort(col, kind="stable")           # each shard's examples in table order
    uniq, start = np.unique(col[order], return_index=True)
    per_shard = {int(s): torch.from_numpy(v.copy()) for s, v in zip(uniq, np.split(order, start[1:]))}
    ids = torch.tensor(sorted(per_shard))
    if split != "full" and len(ids) < world:
        raise DataError(f"data.dir: {len(ids)} training shard(s) for {world} disjoint windows; write more, "
                        f"smaller shards (python -m parle_hvd.shards write ... --per-shard N)")
    windows = [ids[D.replica_indices(len(ids), rank=r, world=world, split=split, frac=frac, seed=seed)].tolist()
               for r in range(world)]
    return per_shard, windows


# --------------------------------------------------------------------------- the training feed
class MemoryFeed:
    """In memory: the sampler's batch, indexed where the data lives, pad-crop/flip applied
    to the whole batch (``data.augment=crop``)."""

    def __init__(self, ds, sampler, *, augment: str, aug_gen):
        self.ds, self.sampler, self.augment, self.aug_gen = ds, sampler, augment, aug_gen
        self.skipped = 0

    def next(self) -> tuple:
        b = self.sampler.next()
        x = self.ds.train_x[b]
        return (augment_batch(x, self.aug_gen) if self.augment == "crop" else x), self.ds.train_y[b]

    def reset(self) -> None:
        pass

    close = reset


class _Items:
    """A replica's stream of item lists for the DataLoader's ``batch_sampler``: (index,
    crop seed, the image's bytes for shards). Apart from the feed on purpose: a generator
    of the feed's own would close a reference cycle through the DataLoader, and a cycle is
    freed by the garbage collector, which runs the multiprocessing queues' finalizers before
    the DataLoader's: its workers then never hear the shutdown and each costs 10 s (seen here)."""

    def __init__(self, ds: StreamedData, sampler, *, replica: int, seed: int):
        self.ds, self.sampler, self.replica, self.seed = ds, sampler, replica, seed
        self.pool: Optional[ThreadPoolExecutor] = None

    def __call__(self, epoch: int, pos: int):
        B, tag = self.sampler.batch_size, ("rrc", self.seed, self.replica)
        if isinstance(self.sampler, ShardSampler):
            yield from self._shard_items(epoch, pos)
            return
        for e, p, idx in self.sampler.batches_from(epoch, pos):
            yield [(int(i), seed_of(*tag, e, p * B + j), None) for j, i in enumerate(idx.tolist())]

    def _read_group(self, members: list) -> dict:
        out = {}
        for s in members:
            try:
                out[s] = Path(self.ds.train.shards[s]).read_bytes()
            except OSError as e:
                raise DataError(f"{self.ds.train.shards[s]}: cannot read ({e.strerror or e})") from None
        return out

    def _shard_items(self, epoch: int, pos: int):
        """Batches with each example's bytes, sliced from whole shards read in order; the next
        group is read by a thread while this one is served."""
        B, t = self.sampler.batch_size, self.ds.train
        self.pool = self.pool or ThreadPoolExecutor(1, thread_name_prefix="parle-shards")
        cache, ahead, key = {}, {}, None
        for e, p, idx, groups, gid in self.sampler.batches_from(epoch, pos):
            if key != e:                  # a new pass: a new plan, nothing of the old one kept
                cache, ahead, key = {}, {}, e
            need = sorted(set(gid.tolist()))
            for g in list(cache):
                if g < need[0]:
                    del cache[g]
            for g in need:
                if g not in cache:
                    cache[g] = (ahead.pop(g) if g in ahead else self.pool.submit(self._read_group, groups[g])).result()
            nxt = need[-1] + 1
            if nxt < len(groups) and nxt not in ahead and nxt not in cache:
                ahead[nxt] = self.pool.submit(self._read_group, groups[nxt])
            items = []
            for j, (i, g) in enumerate(zip(idx.tolist(), gid.tolist())):
                s, off, size = t.shard_row(i)
                items.append((i, seed_of("rrc", self.seed, self.replica, e, p * B + j),
                              cache[g][s][off:off + size]))
            yield items

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


class StreamFeed:
    """Streamed: a DataLoader over the sampler's batches from its position. The trainer's
    ``next()`` advances the sampler; the workers may have decoded further ahead, but a
    checkpoint saves the position taken, so a resume restarts the workers there."""

    def __init__(self, ds: StreamedData, sampler, *, augment: str, aug_gen, dev, replica: int, seed: int):
        self.ds, self.sampler, self.augment, self.aug_gen, self.dev = ds, sampler, augment, aug_gen, dev
        self.replica, self.seed = replica, seed
        self._it = None
        self.skipped = 0
        self._items = _Items(ds, sampler, replica=replica, seed=seed)

    def next(self) -> tuple:
        if self._it is None:
            e, p, items = self.sampler.epoch, self.sampler.pos, self._items
            self._it = _Batched(loader(self.ds, self.ds.train, "train", _Batches(lambda: items(e, p))),
                                f"replica {self.replica}")
        b = _check(next(self._it), f"replica {self.replica}")
        self.sampler.advance()
        self.skipped += len(b["skipped"])
        x = b["x"].to(self.dev, non_blocking=True)
        if self.augment == "crop":
            x = augment_batch(x, self.aug_gen)
        return x, b["y"].to(self.dev, non_blocking=True)

    def reset(self) -> None:
        """Forget the workers' prefetched batches (after the sampler's state was loaded):
        the next batch restarts them at the sampler's position."""
        self.close()

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None:
            it.close()                   # the workers end now, not when the feed is freed
        self._items.close()


def make_feed(ds, sampler, *, augment: str, aug_gen, dev, replica: int, seed: int):
    if getattr(ds, "streamed", False):
        return StreamFeed(ds, sampler, augment=augment, aug_gen=aug_gen, dev=dev, replica=replica, seed=seed)
    return MemoryFeed(ds, sampler, augment=augment, aug_gen=aug_gen)


# --------------------------------------------------------------------------- opening a streamed dataset
def _hold_out(t: Table, frac: float, seed: int) -> tuple:
    """data.hold_out's stratified split, over a table's labels (nothing decoded)."""
    val, keep = [], []
    for c in torch.unique(t.labels).tolist():
        idx = (t.labels == c).nonzero(as_tuple=True)[0]
        idx = idx[torch.randperm(len(idx), generator=D._gen("val-split", seed, c))]
        n_val = int(round(frac * len(idx)))
        val.append(idx[:n_val])
        keep.append(idx[n_val:])
    val_i, keep_i = torch.cat(val).sort().values, torch.cat(keep).sort().values
    if len(val_i) == 0 or len(keep_i) == 0:
        raise DataError(f"data.val_frac {frac}: leaves an empty validation or training set ({len(t)} training examples)")
    return t.subset(keep_i.tolist()), t.subset(val_i.tolist())


def _image_tables(c, seed: int) -> tuple:
    from . import shards
    if c.name == "shards":
        classes, (trf, trr), (tef, ter) = shards.read_shards(c.dir)
        mk = lambda files, rows: Table("shards", [(r[0], r[2], r[3]) for r in rows],
                                       torch.tensor([r[4] for r in rows], dtype=torch.int64), files,
                                       names=[r[1] for r in rows])
        return classes, mk(trf, trr), mk(tef, ter)
    classes, train, test = D.folder_split(c.dir, c.test_frac, seed)
    mk = lambda rows: Table("files", [f for f, _ in rows], torch.tensor([y for _, y in rows], dtype=torch.int64))
    return classes, mk(train), mk(test)


def _options(c, gpu: bool) -> dict:
    # page-locked batches only for a GPU replica: on a CPU replica of a GPU host the
    # DataLoader's pinning thread would open a CUDA context on GPU 0 in every rank
    return dict(workers=c.workers, prefetch=c.prefetch, pin=c.pin_memory and gpu,
                context=worker_start(c.worker_start), skip_corrupt=c.skip_corrupt, shuffle_shards=c.shuffle_shards,
                crop_frac=c.crop_frac)


def image_size_of(t: Table, c) -> int:
    """data.image_size, or (0) the first training image's width: with data.skip_corrupt,
    the first readable one's (the in-memory path's rule, which only reads readable sets)."""
    if c.image_size:
        return c.image_size
    for i in range(len(t)):
        try:
            with D.open_image(t.read(i), t.name(i)) as im:
                return im.size[0]
        except DataError:
            if not c.skip_corrupt:
                raise
    raise DataError(f"data.skip_corrupt: every one of the {len(t)} training images is unreadable")


def open_images(c, seed: int, *, gpu: bool = False) -> StreamedData:
    """A streamed image folder or set of shards: the tables of examples, and the
    normalisation statistics (and gray or colour) from a fixed sample of ``data.stats_sample``
    training images (all of them when there are fewer: then the same numbers as in memory)."""
    classes, tr, te = _image_tables(c, seed)
    recipe = "imagenet" if c.augment == "imagenet" else "fixed"
    size = image_size_of(tr, c)
    k = min(c.stats_sample, len(tr))
    sample = torch.randperm(len(tr), generator=D._gen("stats", seed))[:k].sort().values.tolist()
    gray = D.is_gray(((tr.read(i), tr.name(i)) for i in sample), c.skip_corrupt)     # if every sampled image is (in memory: every image)
    d = StreamedData(c.name, tr, te, None, len(classes), None, None, (1 if gray else 3, size, size),
                     recipe=recipe, size=size, gray=gray, **_options(c, gpu))
    st = D.PixelStats()
    for x, _ in train_examples(d, [sample[i:i + 256] for i in range(0, k, 256)]):
        st.add(x)
        D.PROGRESS[0] += len(x)
    d.mean, d.std = st.result()
    return d


def open_target(c, parts: tuple, *, gpu: bool = False) -> StreamedData:
    """``data.target``'s datasets (``parts``), read one example at a time in the workers.
    The number of classes is the training set's ``classes`` (torchvision's convention) or
    ``num_classes``, if it has one: counting the labels would read every example."""
    tables = [Table("target", list(range(len(p))), None, ds=p) for p in parts]
    try:
        x = torch.as_tensor(parts[0][0][0])
    except Exception as e:
        raise DataError(f"data.target: reading training example 0 raised {type(e).__name__}: {e}") from None
    ncls = getattr(parts[0], "num_classes", None) or len(getattr(parts[0], "classes", None) or ())
    return StreamedData(f"target:{c.target}", tables[0], tables[1], tables[2] if len(tables) == 3 else None,
                        ncls, None, None, tuple(x.shape), input_dtype=str(x.dtype).replace("torch.", ""),
                        **_options(c, gpu))


def decoded_bytes(c, seed: int, parts=None) -> float:
    """What the in-memory path would hold of the training and test sets, in bytes (for
    data.stream=auto): examples x channels x size^2, or a target's examples (``parts``) x
    the first's size."""
    if c.target:
        try:
            x = torch.as_tensor(parts[0][0][0])
        except Exception as e:
            raise DataError(f"data.target: reading training example 0 raised {type(e).__name__}: {e}") from None
        return float(sum(len(p) for p in parts[:2]) * x.numel() * x.element_size())
    classes, tr, te = _image_tables(c, seed)
    size = image_size_of(tr, c)
    return float((len(tr) + len(te)) * 3 * size * size)


def limit(d: StreamedData, c, seed: int) -> StreamedData:
    """data.train_limit, data.test_limit and data.val_frac, on the tables."""
    if c.train_limit:
        d.train = d.train.subset(range(min(c.train_limit, len(d.train))))
    if c.test_limit:
        d.test = d.test.subset(range(min(c.test_limit, len(d.test))))
    if c.val_frac:
        d.train, d.val = _hold_out(d.train, c.val_frac, seed)
    return d
