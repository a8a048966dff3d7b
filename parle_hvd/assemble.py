"""What a run is assembled from, before its first collective: the device, the dataset, the
model, the loss and metric (built in, or the user's by import path: targets.py), and the
card that makes ``final.pt`` usable alone. Nothing here communicates; every rank calls
the same functions alike, so a bad target ends every rank with the same one line."""
from __future__ import annotations

import os
import random

import numpy as np
import torch
from torch import nn

from . import comm, slurm, stream
from .config import Config, to_dict
from .data import hold_out, load_dataset, to_input
from .models import build_model
from .rundir import RunError
from .targets import Objective, TargetError, build_user_model, check_loss, load_user_dataset, objective, user_datasets


def configure_torch(cfg: Config) -> None:
    """Threads per rank (dist.threads) and deterministic kernels (run.deterministic); without
    them, cuDNN picks its fastest convolution for each shape (benchmark mode), and float32
    matmuls may use TF32 (what "high" precision means on an Ampere or later GPU)."""
    if cfg.dist.threads:
        torch.set_num_threads(cfg.dist.threads)
    if cfg.run.deterministic:         # a GPU's kernels may pick algorithms by timing, or add atomically
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def local_place() -> tuple:
    """(local rank, ranks on this host): the engine's once it is running, else the
    launcher's variables (torchrun, Horovod, OpenMPI, MVAPICH, SLURM, MPICH)."""
    if comm.size() > 1:
        return comm.local_rank(), comm.local_size()
    e = os.environ
    for r, n in (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
                 ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                 ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        if r in e:
            return int(e[r]), int(e.get(n, 1))
    if "SLURM_LOCALID" in e:
        st = slurm.step_layout(e)
        return st["local_rank"], st["local_size"]
    return 0, 1


def gpu_index(n_visible: int, local_rank: int, local_size: int, *, visible: str | None, share: bool) -> int:
    """Which of the ``n_visible`` GPUs this rank takes. One visible device is ``cuda:0``
    when it is this rank's own (a single rank on the host, or ``CUDA_VISIBLE_DEVICES``
    naming one device: the scheduler's per-rank binding, SLURM's ``--gpus-per-task=1``);
    several are taken by local rank; fewer devices than ranks on the host is an error
    unless ``share`` (then round-robin)."""
    if n_visible < 1:
        raise RunError("dist.device: cuda requested but no GPU is visible (CUDA_VISIBLE_DEVICES="
                       f"{visible!r})" if visible is not None else "dist.device: cuda requested but no GPU is visible")
    bound = visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1
    if n_visible == 1 and (local_size == 1 or bound):
        return 0
    if local_size > n_visible and not share:
        raise RunError(f"dist.device: {local_size} ranks on this host but {n_visible} GPU(s) visible to each; start "
                       f"one rank per GPU, bind one GPU to each rank (CUDA_VISIBLE_DEVICES, --gpus-per-task=1), "
                       f"or set dist.share_device=true to share them (the sync then goes over Gloo)")
    return local_rank % n_visible


def pick_device(want: str, share: bool = False) -> torch.device:
    """One GPU per rank (``gpu_index``), or the CPU."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RunError("dist.device: cuda requested but torch.cuda.is_available() is False")
    lr, ls = local_place()
    i = gpu_index(torch.cuda.device_count(), lr, ls, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), share=share)
    torch.cuda.set_device(i)
    return torch.device("cuda", i)


def streams(cfg: Config, parts=None) -> bool:
    """Whether the run streams its data (stream.py) rather than hold it decoded in memory."""
    d = cfg.data
    if d.stream != "auto":
        return d.stream == "true"
    if d.name == "shards" and not d.target or d.augment == "imagenet":
        return True
    if not (d.target or d.name == "folder"):
        return False
    return stream.decoded_bytes(d, cfg.train.seed, parts) > d.memory_limit * stream.GiB


def load_data(cfg: Config):
    """The dataset (built in, or data.target's), with its limits and validation split: in
    memory (data.Dataset), or streamed (stream.StreamedData) when ``streams(cfg)``."""
    try:
        return _load_data(cfg)
    except TargetError as e:
        raise RunError(str(e)) from None


def _load_data(cfg: Config):
    d = cfg.data
    parts = user_datasets(d.target, d.kwargs) if d.target else None
    if streams(cfg, parts):
        gpu = cfg.dist.device != "cpu" and torch.cuda.is_available()      # as pick_device decides
        ds = stream.open_target(d, parts, gpu=gpu) if d.target else stream.open_images(d, cfg.train.seed, gpu=gpu)
        if d.target and not ds.num_classes and not cfg.model.target:
            raise RunError(f"model.name: {cfg.model.name} needs the number of classes, which a streamed data.target "
                           f"does not give (give the training set a `classes` list, or set model.target)")
        ds = stream.limit(ds, d, cfg.train.seed)
        # a rank waiting for a batch says so (with its workers' stacks) before another rank's
        # watchdog, waiting for it in a collective, ends the job after dist.timeout: half of
        # it, or 60 s for a fork server's first workers (they import the script and the
        # user's files), but always under it
        t = cfg.dist.timeout
        ds.stall = min(max(60.0, t / 2), 0.75 * t) if t > 0 else 0.0
        return ds
    if d.target:
        ds = load_user_dataset(d.target, d.kwargs, parts)
        if d.train_limit:
            ds.train_x, ds.train_y = ds.train_x[:d.train_limit], ds.train_y[:d.train_limit]
        if d.test_limit:
            ds.test_x, ds.test_y = ds.test_x[:d.test_limit], ds.test_y[:d.test_limit]
    else:
        ds = load_dataset(d.name, d.dir, d.train_limit, d.test_limit, cfg=d, seed=cfg.train.seed)
    if d.val_frac:                  # the same split on every rank: it depends on the seed only
        ds = hold_out(ds, d.val_frac, seed=cfg.train.seed)
    return ds


def new_model(cfg: Config, ds) -> nn.Module:
    """model.target's module, or the built-in model.name sized to the dataset."""
    m = cfg.model
    if m.target:
        net = build_user_model(m.target, m.kwargs)
    else:
        try:
            net = build_model(m.name, num_classes=ds.num_classes, in_channels=ds.shape[0], image_size=ds.shape[1],
                              dropout=m.dropout, depth=m.depth, width=m.width)
        except RuntimeError as e:   # a built-in net measures its features on a zero input: too small for it
            raise RunError(f"model.name: {m.name} cannot take {list(ds.shape)} inputs (data.image_size); "
                           f"{str(e).splitlines()[0]}") from None
    t = cfg.train
    if t.accum > 1 and t.batch_size // t.accum < 2 and any(isinstance(x, nn.modules.batchnorm._BatchNorm)
                                                             for x in net.modules()):
        # BatchNorm in training cannot normalise one example: say so before the first step does
        raise RunError(f"train.accum: micro-batches of {t.batch_size // t.accum} example(s) (train.batch_size "
                       f"{t.batch_size} / {t.accum}), but the model has BatchNorm, which needs at least 2")
    return net


def resolve_objective(cfg: Config, ds=None) -> tuple[Objective, object]:
    """The loss and metric, and any model, dataset, loss or metric named by import path,
    imported and tried once (a forward and the loss on two examples); returns the objective
    and the dataset (``ds``, or loaded for the trial; None when no trial was needed).
    Raises RunError."""
    try:
        obj = objective(cfg.train.loss, cfg.eval.metric)
        if not (cfg.model.target or cfg.data.target or not obj.builtin_loss or obj.metric_fn is not None):
            return obj, ds
        ds = load_data(cfg) if ds is None else ds
        rng = torch.get_rng_state()
        dtype = getattr(torch, cfg.model.dtype)
        try:
            model = new_model(cfg, ds).to(dtype=dtype)
        except TargetError:
            raise
        except Exception as e:         # a built-in model given data.target's examples, say
            raise TargetError(f"model.name: {cfg.model.name} cannot take the data's inputs of shape "
                              f"{tuple(ds.shape)} ({type(e).__name__}: {e}); set model.target") from None
        x2, y2 = next(iter(stream.train_examples(ds, [[0, 1] if ds.n_train > 1 else [0]])))
        check_loss(obj, model, to_input(x2, ds.mean, ds.std, dtype), y2, cfg.train.loss,
                   "model.target" if cfg.model.target else "model.name")
        torch.set_rng_state(rng)       # the trial leaves the run's random streams as they were
        return obj, ds
    except TargetError as e:
        raise RunError(str(e)) from None


def inference_card(cfg: Config, ds, metric: str) -> dict:
    """What final.pt (the reference's state_dict, loadable with weights_only=True into the
    model's own class) needs to be used alone: the model and how it was built, the input's
    shape and normalisation, and the resolved config."""
    return {"weights": "final.pt", "model": {"name": "" if cfg.model.target else cfg.model.name,
                                             "target": cfg.model.target, "kwargs": cfg.model.kwargs,
                                             "dtype": cfg.model.dtype},
            "input": {"shape": list(ds.shape), "dtype": ds.input_dtype if getattr(ds, "streamed", False) else
                      str(ds.train_x.dtype).replace("torch.", ""),
                      # built-in images: input = (uint8 / 255 - mean) / std, per channel
                      "mean": list(ds.mean) if ds.mean is not None else None,
                      "std": list(ds.std) if ds.std is not None else None,
                      # how an image becomes that input (data.decode_image)
                      "resize": None if cfg.data.target or cfg.data.name not in ("folder", "shards") else
                      ("shorter side to size / crop_frac, then the central size x size, bilinear"
                       if cfg.data.augment == "imagenet" else "the whole image to size x size, bilinear"),
                      "crop_frac": cfg.data.crop_frac if cfg.data.augment == "imagenet" else None},
            "num_classes": ds.num_classes, "metric": metric, "algo": cfg.algo, "config": to_dict(cfg)}


def seed_replica(seed: int) -> None:
    """Every global random stream a replica's initialisation draws from."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state(dev: torch.device) -> dict:
    """The global random streams, as tensors and numbers only, so that a checkpoint loads
    with ``torch.load(weights_only=True)`` (numpy's state is not pickled)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {"rng_torch": torch.get_rng_state(), "rng_py": random.getstate(),
            "rng_np": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "rng_cuda": torch.cuda.get_rng_state() if dev.type == "cuda" else None}


def set_rng_state(st: dict, dev: torch.device) -> None:
    torch.set_rng_state(st["rng_torch"])
    random.setstate(st["rng_py"])
    np_st = st["rng_np"]
    if isinstance(np_st, dict):
        np_st = (np_st["name"], np_st["key"].numpy().astype(np.uint32), np_st["pos"], np_st["has_gauss"],
                 np_st["gauss"])
    np.random.set_state(np_st)       # (a tuple: a checkpoint from before weights-only files)
    if dev.type == "cuda" and st.get("rng_cuda") is not None:
        torch.cuda.set_rng_state(st["rng_cuda"])
