"""Typed configuration: dataclasses, YAML files, ``key.sub=value`` overrides.

    python train.py --config configs/fashion_parle.yaml parle.sync_period=50 train.epochs=3

Every field has a default and a one-line meaning (``python train.py --help`` lists them).
Unknown keys, wrong types and out-of-range values raise ``ConfigError`` naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Union

import yaml


class ConfigError(ValueError):
    """Bad configuration; the message names the key."""


def _f(default, help: str, choices=None):
    md = {"help": help}
    if choices:
        md["choices"] = tuple(choices)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=md)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=md)
    return field(default=default, metadata=md)


def _check(cond: bool, key: str, msg: str):
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclass
class DataConfig:
    name: str = _f("fashion-mnist", "dataset (folder: class subfolders of PNG/JPEG images; shards: WebDataset-style "
                   "tar shards, python -m parle_hvd.shards)",
                   ["fashion-mnist", "mnist", "cifar10", "cifar100", "svhn", "folder", "shards"])
    dir: str = _f("", "directory with the dataset files ('' = the dataset's default location)")
    test_frac: float = _f(0.1, "folder without train/ and test/: fraction of each class held out for test")
    image_size: int = _f(0, "folder, shards: resize images to this square size (0 = the first image's width)")
    svhn_extra: bool = _f(False, "svhn: add extra_32x32.mat to the training set")
    split: str = _f("full", "full: every replica sees all data; frac: replica i sees a window of "
                    "data.frac of it starting at i/n (PARLE.md)", ["full", "frac"])
    frac: float = _f(1.0, "fraction of the training data each replica sees when split=frac, in (0, 1]")
    train_limit: int = _f(0, "use only the first N training examples (0 = all; an IDX file is read only that far)")
    test_limit: int = _f(0, "use only the first N test examples (0 = all; an IDX file is read only that far)")
    augment: str = _f("off", "training augmentation: off; crop (true): random 4-pixel pad-and-crop and horizontal "
                      "flip of each batch; imagenet: RandomResizedCrop + flip at decode, resize + center crop "
                      "for evaluation (streamed)", ["off", "crop", "imagenet", "on", "true", "false", "none"])
    stream: str = _f("auto", "folder, shards, data.target: decode in DataLoader workers instead of holding the "
                     "decoded set in memory; auto: when it would exceed data.memory_limit (always for shards "
                     "and augment=imagenet)", ["auto", "true", "false", "on", "off"])
    memory_limit: float = _f(4.0, "data.stream=auto: GiB per rank the decoded training and test sets may take in memory")
    workers: int = _f(2, "streamed: DataLoader worker processes per rank decoding examples (0: in the training process)")
    prefetch: int = _f(2, "streamed: batches each worker decodes ahead")
    pin_memory: bool = _f(True, "streamed, on a GPU: page-locked batches, copied to the device without blocking")
    worker_start: str = _f("auto", "streamed: how workers start (multiprocessing context); auto: forkserver in a "
                           "job that joined a world (the engine's threads are running: a fork of such a process "
                           "can deadlock in the child), fork in a single process without a launcher",
                           ["auto", "fork", "spawn", "forkserver"])
    stats_sample: int = _f(2000, "folder, shards: normalisation mean/std from this many training images "
                           "(a fixed sample by train.seed; all when fewer); saved in final.json")
    skip_corrupt: bool = _f(False, "streamed: an unreadable image is replaced by the next readable one and "
                            "counted, with a warning naming it (else the run stops naming the file)")
    shuffle_shards: int = _f(4, "shards: examples are mixed across this many shards at a time (memory: about "
                             "3 x this many shards' bytes per rank)")
    crop_frac: float = _f(0.875, "augment=imagenet: evaluation resizes the shorter side to image_size / crop_frac, "
                          "then takes the central image_size square")
    val_frac: float = _f(0.0, "hold out this fraction of each class of the training set as a validation split "
                         "(fixed by train.seed), evaluated with the test set (valid/* metrics)")
    target: str = _f("", "your dataset instead of data.name: module:function or file.py:function returning "
                     "(train, test) or (train, test, validation) torch Datasets of (input, target) pairs")
    kwargs: Dict[str, Any] = _f({}, "keyword arguments for data.target")

    def __post_init__(self):
        _check(0.0 < self.frac <= 1.0, "data.frac", f"must be in (0, 1], got {self.frac}")
        _check(self.train_limit >= 0, "data.train_limit", "must be >= 0")
        _check(self.test_limit >= 0, "data.test_limit", "must be >= 0")
        _check(0.0 < self.test_frac < 1.0, "data.test_frac", f"must be in (0, 1), got {self.test_frac}")
        _check(0.0 <= self.val_frac < 1.0, "data.val_frac", f"must be in [0, 1), got {self.val_frac}")
        _check(self.image_size >= 0, "data.image_size", "must be >= 0")
        self.augment = {"on": "crop", "true": "crop", "false": "off", "none": "off"}.get(self.augment, self.augment)
        self.stream = {"on": "true", "off": "false"}.get(self.stream, self.stream)
        _check(self.memory_limit > 0, "data.memory_limit", f"must be > 0 (GiB), got {self.memory_limit}")
        _check(self.workers >= 0, "data.workers", f"must be >= 0, got {self.workers}")
        _check(self.prefetch >= 1, "data.prefetch", f"must be >= 1, got {self.prefetch}")
        _check(self.stats_sample >= 1, "data.stats_sample", f"must be >= 1, got {self.stats_sample}")
        _check(self.shuffle_shards >= 1, "data.shuffle_shards", f"must be >= 1, got {self.shuffle_shards}")
        _check(0.0 < self.crop_frac <= 1.0, "data.crop_frac", f"must be in (0, 1], got {self.crop_frac}")
        streamable = self.target or self.name in ("folder", "shards")
        _check(self.stream != "true" or streamable, "data.stream",
               f"true is for data.name=folder or shards, or data.target ({self.name} is read into memory)")
        _check(self.stream != "false" or self.name != "shards", "data.stream", "false: tar shards are always streamed")
        _check(self.augment != "imagenet" or self.stream != "false", "data.augment",
               "imagenet crops the original images at decode: it needs data.stream=auto or true")
        _check(self.augment != "imagenet" or (streamable and not self.target), "data.augment",
               "imagenet is for data.name=folder or shards")
        _check(self.augment != "imagenet" or self.image_size > 0, "data.image_size",
               "set it with data.augment=imagenet (224 for ImageNet)")
        # a data.target dataset holds any kind of example: no class-stratified split, no image augmentation
        _check(not (self.target and self.val_frac), "data.val_frac",
               "not with data.target: return the validation set from it, (train, test, validation)")
        _check(not (self.target and self.augment != "off"), "data.augment", "not with data.target (its examples are read "
               "once and kept; pad-crop and flip are for the built-in image datasets)")


@dataclass
class ModelConfig:
    name: str = _f("lenet", "network", ["lenet", "allcnn", "wrn", "resnet18"])
    dropout: float = _f(-1.0, "dropout probability (-1 = the model's default: LeNet 0.25, All-CNN-C 0.5, WRN 0, ResNet-18 0)")
    depth: int = _f(28, "WRN depth d (6n+4)")
    width: int = _f(10, "WRN widening factor k")
    dtype: str = _f("float32", "parameter dtype", ["float32", "float64"])
    target: str = _f("", "your model instead of model.name: module:function or file.py:function returning a "
                     "torch.nn.Module, called with model.kwargs")
    kwargs: Dict[str, Any] = _f({}, "keyword arguments for model.target")

    def __post_init__(self):
        _check(self.dropout == -1.0 or 0.0 <= self.dropout < 1.0, "model.dropout",
               f"must be in [0, 1) (or -1 for the model's default), got {self.dropout}")
        _check(self.depth >= 10 and (self.depth - 4) % 6 == 0, "model.depth", f"must be 6n+4 >= 10, got {self.depth}")
        _check(self.width >= 1, "model.width", "must be >= 1")


@dataclass
class ParleConfig:
    sync_period: int = _f(25, "L: inner steps between two allreduces (one outer step)")
    alpha: float = _f(0.75, "z average: z = alpha*z + (1-alpha)*y")
    gamma0_inv: float = _f(0.01, "1/gamma0: initial inner (local-entropy) coupling")
    gamma_min_inv: float = _f(1.0, "1/gamma_min: cap of the inner coupling")
    rho0_inv: float = _f(1.0, "1/rho0: initial elastic coupling toward the reference (parle and elastic)")
    rho_min_inv: float = _f(10.0, "1/rho_min: cap of the elastic coupling")
    scoping: Union[float, str] = _f(0.5, "s: couplings grow by (1 + s/nb) per outer step (PARLE.md); auto: each "
                                    "grows geometrically from its start to its cap at parle.scoping_end of the run")
    scoping_end: float = _f(1.0, "scoping=auto: the fraction of the run (of train.epochs) at which both couplings "
                            "reach their caps")
    init: str = _f("independent", "replica initialisation: independent (seed + rank) or "
                   "broadcast (rank 0's weights)", ["independent", "broadcast"])
    overlap: bool = _f(False, "algo=parle: start each outer step's sync without waiting for it; the next "
                       "inner loop runs while it travels and the pull waits for it (docs/algorithm.md)")
    balance: str = _f("off", "algo=parle: time = rank 0 gives each replica a number of inner steps in "
                      "proportion to its measured speed, n*L in all (replicas of unequal speed)", ["off", "time"])

    def __post_init__(self):
        _check(self.sync_period >= 1, "parle.sync_period", f"must be >= 1, got {self.sync_period}")
        _check(0.0 <= self.alpha < 1.0, "parle.alpha", f"must be in [0, 1), got {self.alpha}")
        _check(self.scoping == "auto" or (isinstance(self.scoping, float) and self.scoping >= 0.0), "parle.scoping",
               f"must be a number >= 0 or auto, got {self.scoping!r}")
        _check(0.0 < self.scoping_end <= 1.0, "parle.scoping_end", f"must be in (0, 1], got {self.scoping_end}")
        for k in ("gamma0_inv", "gamma_min_inv", "rho0_inv", "rho_min_inv"):
            _check(getattr(self, k) >= 0.0, f"parle.{k}", f"must be >= 0, got {getattr(self, k)}")
        _check(self.gamma_min_inv >= self.gamma0_inv, "parle.gamma_min_inv", "must be >= parle.gamma0_inv")
        _check(self.rho_min_inv >= self.rho0_inv, "parle.rho_min_inv", "must be >= parle.rho0_inv")


@dataclass
class OptimConfig:
    lr: float = _f(0.1, "initial learning rate (parle: the inner lr, held fixed, and the start of the outer schedule)")
    momentum: float = _f(0.9, "mu: momentum of every SGD-type step (parle: inner and outer)")
    nesterov: bool = _f(True, "Nesterov momentum (else heavy ball)")
    schedule: str = _f("step", "outer learning-rate schedule", ["constant", "step", "cosine"])
    milestones: List[float] = _f([], "step schedule: passes over the data at which lr *= decay")
    decay: float = _f(0.2, "step schedule: factor at each milestone")
    warmup_passes: float = _f(0.0, "linear warm-up of the outer lr over this many passes")
    weight_decay: float = _f(0.0, "wd: L2 coefficient in the inner gradient")

    def __post_init__(self):
        _check(self.lr > 0.0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(0.0 <= self.momentum < 1.0, "optim.momentum", f"must be in [0, 1), got {self.momentum}")
        _check(0.0 < self.decay <= 1.0, "optim.decay", f"must be in (0, 1], got {self.decay}")
        _check(self.weight_decay >= 0.0, "optim.weight_decay", "must be >= 0")
        _check(self.warmup_passes >= 0.0, "optim.warmup_passes", "must be >= 0")
        _check(list(self.milestones) == sorted(self.milestones), "optim.milestones", "must be increasing")


@dataclass
class ElasticConfig:
    sync_period: int = _f(1, "tau: steps between two references (Elastic-SGD averages every step by default)")
    momentum: float = _f(0.0, "momentum of the Elastic-SGD step (0 = PARLE.md's form; Nesterov or heavy ball "
                         "as optim.nesterov)")

    def __post_init__(self):
        _check(self.sync_period >= 1, "elastic.sync_period", f"must be >= 1, got {self.sync_period}")
        _check(0.0 <= self.momentum < 1.0, "elastic.momentum", f"must be in [0, 1), got {self.momentum}")


@dataclass
class EntropyConfig:
    noise: float = _f(0.0, "Langevin noise: y += sqrt(lr) * noise * N(0, I) after each inner step (0 = off)")

    def __post_init__(self):
        _check(self.noise >= 0.0, "entropy.noise", "must be >= 0")


@dataclass
class LocalSGDConfig:
    sync_period: int = _f(25, "steps between two averagings of the replicas")

    def __post_init__(self):
        _check(self.sync_period >= 1, "localsgd.sync_period", f"must be >= 1, got {self.sync_period}")


@dataclass
class DiLoCoConfig:
    sync_period: int = _f(25, "H: inner steps per round")
    inner: str = _f("sgd", "inner optimizer: sgd (Nesterov, optim.*) or adamw", ["sgd", "adamw"])
    inner_lr: float = _f(0.0, "inner learning rate (0 = optim.lr)")
    outer_lr: float = _f(0.7, "outer Nesterov SGD learning rate (DiLoCo default 0.7)")
    outer_momentum: float = _f(0.9, "outer Nesterov momentum (DiLoCo default 0.9)")

    def __post_init__(self):
        _check(self.sync_period >= 1, "diloco.sync_period", f"must be >= 1, got {self.sync_period}")
        _check(self.inner_lr >= 0.0, "diloco.inner_lr", "must be >= 0")
        _check(self.outer_lr > 0.0, "diloco.outer_lr", "must be > 0")
        _check(0.0 <= self.outer_momentum < 1.0, "diloco.outer_momentum", "must be in [0, 1)")


@dataclass
class DPSGDConfig:
    fp16: bool = _f(False, "compress gradients to float16 on the wire (hvd.Compression.fp16; a DDP hook under torch)")
    bucket_mb: float = _f(25.0, "dist.engine=torch: DistributedDataParallel's gradient bucket size in MB "
                          "(bucket_cap_mb; Horovod's counterpart is HOROVOD_FUSION_THRESHOLD)")
    lr_scale: str = _f("none", "scale optim.lr with the world size n: none, linear (lr*n) or sqrt (lr*sqrt(n))",
                       ["none", "linear", "sqrt"])

    def __post_init__(self):
        _check(self.bucket_mb > 0, "dpsgd.bucket_mb", f"must be > 0, got {self.bucket_mb}")


@dataclass
class TrainConfig:
    epochs: float = _f(10.0, "passes over each replica's data (not the authors' 'epochs', PARLE.md)")
    batch_size: int = _f(128, "mini-batch per replica")
    seed: int = _f(42, "base seed; replica a uses seed + a for its weights and data order")
    block: int = _f(25, "sgd, dpsgd: optimizer steps per outer step (the unit of logging, evaluation "
                    "and checkpoints; these algorithms have no sync of their own)")
    loss: str = _f("cross_entropy", "training (and evaluation) loss: cross_entropy (over the last dimension; "
                   "a sequence's every position), or module:function / file.py:function (output, target) -> scalar")
    precision: str = _f("fp32", "forward and backward under autocast at this precision (bf16, fp16 with a GradScaler: "
                        "a step whose gradients overflow is skipped); weights, Parle's state and the sync stay "
                        "fp32", ["fp32", "bf16", "fp16"])
    accum: int = _f(1, "micro-batches per inner step: train.batch_size (a multiple of it) is cut into this many "
                    "equal pieces whose gradients add up (the memory of batch_size/accum; the same effective "
                    "batch, lr and schedules)")
    compile: bool = _f(False, "torch.compile the model (Inductor); the reference is evaluated through the same "
                       "compiled module; compiled graphs counted in summary.json")
    channels_last: bool = _f(False, "conv nets: weights and inputs in channels-last memory format (faster "
                             "convolutions on tensor cores)")

    def __post_init__(self):
        _check(self.epochs > 0, "train.epochs", f"must be > 0, got {self.epochs}")
        _check(self.accum >= 1, "train.accum", f"must be >= 1, got {self.accum}")
        _check(self.batch_size % self.accum == 0, "train.accum",
               f"must divide train.batch_size ({self.batch_size}), got {self.accum}: micro-batches of one size "
               "(BatchNorm sees the same number of examples each time, and a compiled model one shape)")
        _check(self.block >= 1, "train.block", "must be >= 1")
        _check(self.batch_size >= 1, "train.batch_size", f"must be >= 1, got {self.batch_size}")


@dataclass
class EvalConfig:
    every: float = _f(1.0, "evaluate the reference every this many passes (and at the end)")
    bn_batches: int = _f(20, "recompute the reference's BatchNorm statistics on this many "
                         "training batches before evaluating (0: use the averaged statistics)")
    batch_size: int = _f(1000, "evaluation batch size")
    metric: str = _f("accuracy", "what summary.json and compare report beside the loss: accuracy (argmax over the "
                     "last dimension), loss, perplexity (exp of the mean loss), or module:function / file.py:function "
                     "(output, target) -> a batch's mean, averaged over examples")

    def __post_init__(self):
        _check(self.every > 0, "eval.every", "must be > 0")
        _check(self.bn_batches >= 0, "eval.bn_batches", "must be >= 0")
        _check(self.batch_size >= 1, "eval.batch_size", "must be >= 1")


@dataclass
class RunConfig:
    dir: str = _f("", "run directory ('' = runs/<name>-<timestamp>)")
    name: str = _f("", "run name ('' = the config file's name)")
    resume: bool = _f(False, "continue from the latest complete checkpoint in run.dir "
                      "('' dir: the newest runs/<name>-* with one)")
    ckpt_every: int = _f(50, "checkpoint every this many outer steps (and at the end); 0 = only at the end")
    keep: int = _f(2, "checkpoints kept per rank (>= 2, so a complete one always survives)")
    log_every: int = _f(25, "log scalars every this many inner steps (rounded up to whole outer steps)")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    progress: str = _f("auto", "progress bar on rank 0: auto (when a terminal), bar, lines", ["auto", "bar", "lines"])
    deterministic: bool = _f(False, "torch's deterministic algorithms, cuDNN benchmark off: exact resume on a GPU "
                             "too (on the CPU it holds anyway); slower")

    def __post_init__(self):
        _check(self.ckpt_every >= 0, "run.ckpt_every", "must be >= 0")
        _check(self.keep >= 2, "run.keep", f"must be >= 2, got {self.keep}")
        _check(self.log_every >= 1, "run.log_every", "must be >= 1")


@dataclass
class DistConfig:
    backend: str = _f("auto", "auto: join the job when started by horovodrun/mpirun/srun/torchrun; none: one process; "
                      "horovod: Horovod even without a launcher", ["auto", "horovod", "none"])
    engine: str = _f("auto", "who carries the collectives: horovod, torch (torch.distributed: Gloo on CPUs, NCCL on "
                     "GPUs), auto (the environment's PARLE_HVD_ENGINE if set, else torch under torchrun and Horovod "
                     "under horovodrun/mpirun/srun when it is installed)", ["auto", "horovod", "torch"])
    threads: int = _f(0, "torch threads per rank (0 = cores / ranks on this host)")
    timeout: float = _f(300.0, "seconds any collective may wait before the run fails naming the silent rank "
                        "(0 = wait forever); also Horovod's stall shutdown time; streamed, a rank waits half of it (at "
                        "least 60 s, under it) for a batch from its workers, then prints their stacks and stops")
    expect_ranks: int = _f(0, "the number of ranks this config is meant for (0 = any); a mismatch stops the run")
    device: str = _f("auto", "auto: the GPU of this rank's local rank when CUDA is available, else CPU",
                     ["auto", "cpu", "cuda"])
    share_device: bool = _f(False, "let more ranks than GPUs run on a host, sharing them round-robin (checks "
                            "with Gloo, launch/gpu_check.sh; NCCL refuses two ranks on one GPU, and it is slow)")
    elastic: bool = _f(False, "Horovod elastic mode (horovodrun --min-np/--host-discovery-script, "
                       "launch/elastic.sh): ranks may leave and join; state committed at every sync")
    elastic_commit_every: int = _f(1, "elastic mode: commit (copy this rank's state to host memory) every this "
                                   "many outer steps; a failure replays at most this many")

    def __post_init__(self):
        _check(self.threads >= 0, "dist.threads", "must be >= 0")
        _check(self.expect_ranks >= 0, "dist.expect_ranks", "must be >= 0")
        _check(self.timeout >= 0, "dist.timeout", "must be >= 0")
        _check(self.elastic_commit_every >= 1, "dist.elastic_commit_every", "must be >= 1")
        _check(not (self.backend == "horovod" and self.engine == "torch"), "dist.engine",
               "torch contradicts dist.backend=horovod (which forces Horovod); use dist.backend=auto")


@dataclass
class Config:
    algo: str = _f("parle", "training algorithm (docs/algorithms.md)",
                   ["parle", "sgd", "dpsgd", "elastic", "entropy", "localsgd", "diloco"])
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parle: ParleConfig = field(default_factory=ParleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    localsgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    dpsgd: DPSGDConfig = field(default_factory=DPSGDConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self):
        _check(self.train.precision == "fp32" or self.model.dtype == "float32", "train.precision",
               f"{self.train.precision} autocasts float32 weights (its master copy); model.dtype is {self.model.dtype}")
        # Both rest on Parle's inner loop not reading the reference (docs/algorithm.md); for any
        # other algorithm they would change what it computes (entropy: rank 0's replica, the one
        # evaluated, would run fewer inner steps), so they are refused, not ignored.
        _check(self.algo == "parle" or not self.parle.overlap, "parle.overlap",
               f"is Parle's only (algo=parle), not algo={self.algo}; drop it or set parle.overlap=false")
        _check(self.algo == "parle" or self.parle.balance == "off", "parle.balance",
               f"is Parle's only (algo=parle), not algo={self.algo}; drop it or set parle.balance=off")
        if self.dist.elastic:
            _check(self.algo in ELASTIC_ALGOS, "dist.elastic",
                   f"needs an algorithm with a reference ({', '.join(ELASTIC_ALGOS)}), not algo={self.algo}")
            _check(self.dist.expect_ranks == 0, "dist.expect_ranks",
                   "must be 0 with dist.elastic (the number of ranks changes)")
            _check(not (self.algo == "parle" and self.parle.overlap), "parle.overlap",
                   "not supported with dist.elastic (a sync in flight cannot survive a change of the world)")
            _check(not (self.algo == "parle" and self.parle.balance != "off"), "parle.balance",
                   "not supported with dist.elastic (the assignment is per rank, and ranks come and go)")


# Elastic mode keeps each replica's own state across membership changes and hands a
# joining replica the reference: that needs an algorithm that forms one at every sync.
ELASTIC_ALGOS = ("parle", "elastic", "localsgd", "diloco")


# --------------------------------------------------------------------------- building
def _type_name(tp) -> str:
    if typing.get_origin(tp) in (list, List):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if typing.get_origin(tp) in (dict, Dict):
        return "mapping"
    if typing.get_origin(tp) is Union:
        return "|".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(key: str, tp, value: Any):
    origin = typing.get_origin(tp)
    if origin is Union:                 # Union[float, str]: a number, or a word the field's check accepts
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a number or a word, got {value!r}")
    if origin in (dict, Dict):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values (e.g. {key}={{n_layer: 2}}), got {value!r}")
        try:        # it is written to config.json and into checkpoints: plain JSON values only
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: values must be numbers, strings, booleans, lists or mappings, got {value!r}") from None
        return dict(value)
    if origin in (list, List):
        (inner,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {_type_name(inner)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)         # YAML 1.1 leaves 1e-4 (no dot) a string
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
        if isinstance(value, bool):     # YAML 1.1 reads a bare off/on (no/yes) as a boolean: the word back
            return "on" if value else "off"
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls, d: dict, prefix: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in fields(cls)}
    for k in d:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(f"{where}: unknown key (known: {', '.join(names)})")
    kwargs = {}
    for name, f in names.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, d.get(name, {}) or {}, key)
        elif name in d:
            v = _coerce(key, tp, d[name])
            ch = f.metadata.get("choices")
            if ch and v not in ch:
                raise ConfigError(f"{key}: must be one of {', '.join(ch)}, got {v!r}")
            kwargs[name] = v
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix}: {e}") from None


def _set_path(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        cur = nxt
    cur[parts[-1]] = value


def parse_override(arg: str) -> tuple[str, Any]:
    """``key.sub=value`` -> (``key.sub``, YAML-parsed value)."""
    if "=" not in arg:
        raise ConfigError(f"{arg}: overrides are key.sub=value")
    key, raw = arg.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"{arg}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file {p}")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"--config: YAML syntax error in {p}{where}: "
                          f"{getattr(e, 'problem', None) or e}") from None
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"--config: {p} must hold a mapping of sections")
    return d


def make_config(path: str | Path | None = None, overrides: List[str] = ()) -> Config:
    raw = load_yaml(path) if path else {}
    for o in overrides:
        k, v = parse_override(o)
        _set_path(raw, k, v)
    cfg = _build(Config, raw, "")
    if not cfg.run.name:
        cfg.run.name = Path(path).stem if path else "default"
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def help_text() -> str:
    """Every key with its type, default and meaning."""
    lines = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            tp = hints[f.name]
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(tp):
                walk(tp, key)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            ch = f.metadata.get("choices")
            t = "|".join(ch) if ch else _type_name(tp)
            lines.append(f"  {key:<24} {t:<18} default {default!r:<16} {f.metadata.get('help', '')}")

    walk(Config, "")
    return "\n".join(lines)
