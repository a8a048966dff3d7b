"""Your model, loss, metric and dataset, named by import path in the config, for train.py
and parle_hvd.compare alike, without touching this package:

    python train.py --config configs/fashion_parle.yaml \
        model.target=mypkg.nets:make_net model.kwargs='{width: 64}' \
        data.target=mypkg.data:make train.loss=mypkg.losses:smooth_ce eval.metric=accuracy
    ... model.target=path/to/nets.py:make_net           # a file works as well as a module

* ``model.target``: a callable, called as ``fn(**model.kwargs)``, returning a ``torch.nn.Module``.
* ``data.target``: called as ``fn(**data.kwargs)``, returning ``(train, test)`` or
  ``(train, test, validation)``: map-style torch ``Dataset``s whose items are ``(input,
  target)`` pairs of tensors (or numbers). They are stacked into memory once per rank, so
  every guarantee of the built-in datasets holds (per-replica order, shards, splits,
  exact resume). Inputs are fed as they are: floating inputs cast to ``model.dtype``,
  integer inputs (token ids) unchanged. No normalisation or augmentation is applied.
* ``train.loss``: ``cross_entropy`` (over the last dimension, so a sequence model's
  ``[B, T, V]`` output against ``[B, T]`` targets is the mean over every position), or a
  callable ``fn(output, target)`` returning a scalar tensor (the batch's mean loss).
* ``eval.metric``: ``accuracy`` (argmax over the last dimension), ``loss``, ``perplexity``
  (exp of the mean loss), or a callable ``fn(output, target)`` returning a batch's mean,
  averaged over examples. Reported as ``test_<metric>``/``valid_<metric>``; with
  ``accuracy`` also under the historical names (``val_accuracy``).

``resolve(cfg)`` imports and checks all of it at the start of a run, on every rank, before
any collective; whatever is wrong ends the run with one line naming the key (exit 2).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .data import PROGRESS


class TargetError(ValueError):
    """A target that does not import, is not callable or returns the wrong thing (names the key)."""


_FILES: dict = {}      # module name -> path of data.target's file, where it was named by path


def _import_file(path: Path, *, share: bool = False):
    """The module of a file named by path, under a name made from the path alone (the same in
    every process). ``share``: a dataset's file (data.target), which a DataLoader worker
    started by forkserver or spawn imports again (file_modules)."""
    name = f"parle_hvd_user_{hashlib.sha1(os.fsencode(str(path))).hexdigest()[:16]}"
    module = sys.modules.get(name)
    if module is None:
        sys.path.insert(0, str(path.parent))       # so that the file's own imports of its neighbours work
        sp = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(sp)
        sys.modules[name] = module
        try:
            sp.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    if share:
        _FILES[name] = str(path)
    return module


def file_modules() -> dict:
    """Module name -> path of the dataset files (data.target) imported by path so far."""
    return dict(_FILES)


def import_file_modules(files: dict) -> None:
    """Import, in this process, the files another one imported by path (a DataLoader worker
    started by forkserver or spawn, before it unpickles a dataset whose class lives in one)."""
    for name, path in files.items():
        if name not in sys.modules:
            _import_file(Path(path), share=True)


def load_target(spec: str, key: str) -> Callable:
    """``module.sub:name`` (a module on sys.path / PYTHONPATH) or ``path/to/file.py:name``."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise TargetError(f"{key}: {spec!r} is not module:function or file.py:function")
    try:
        if mod_name.endswith(".py") or "/" in mod_name:
            path = Path(mod_name).expanduser().resolve()
            if not path.is_file():
                raise TargetError(f"{key}: no such file {mod_name}")
            module = _import_file(path, share=key == "data.target")
        else:
            module = importlib.import_module(mod_name)
    except TargetError:
        raise
    except Exception as e:      # the user's module raised while importing: say what, in one line
        raise TargetError(f"{key}: cannot import {mod_name} ({type(e).__name__}: {e})") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise TargetError(f"{key}: {mod_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise TargetError(f"{key}: {spec} is a {type(obj).__name__}, not callable")
    return obj


def _call(fn: Callable, spec: str, key: str, kwargs: dict):
    try:
        return fn(**kwargs)
    except Exception as e:
        raise TargetError(f"{key}: {spec}(**{key.split('.')[0]}.kwargs) raised {type(e).__name__}: {e}") from None


def build_user_model(target: str, kwargs: dict) -> nn.Module:
    """``model.target`` called with ``model.kwargs``; must return an nn.Module with parameters."""
    m = _call(load_target(target, "model.target"), target, "model.target", kwargs)
    if not isinstance(m, nn.Module):
        raise TargetError(f"model.target: {target} returned a {type(m).__name__}, not a torch.nn.Module")
    if not any(True for _ in m.parameters()):
        raise TargetError(f"model.target: {target} returned a module without parameters")
    return m


def _stack(ds, which: str, target: str) -> tuple:
    """A map-style Dataset of (input, target) pairs -> (inputs, targets), stacked."""
    key = "data.target"
    if isinstance(ds, torch.utils.data.TensorDataset) and len(ds.tensors) == 2:
        x, y = ds.tensors
    else:
        try:
            n = len(ds)
        except TypeError:
            raise TargetError(f"{key}: the {which} set from {target} is a {type(ds).__name__}, not a map-style "
                              f"torch Dataset (it has no len())") from None
        if n == 0:
            raise TargetError(f"{key}: the {which} set from {target} is empty (length 0)")
        try:
            items = []
            for i in range(n):
                items.append(ds[i])
                PROGRESS[0] += 1        # the loading heartbeat's count: a long read is not a stuck one
        except Exception as e:
            raise TargetError(f"{key}: reading the {which} set from {target} raised {type(e).__name__}: {e}") from None
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            raise TargetError(f"{key}: the {which} set from {target} must yield (input, target) pairs")
        try:
            x = torch.stack([torch.as_tensor(a) for a, _ in items])
            y = torch.stack([torch.as_tensor(b) for _, b in items])
        except (RuntimeError, TypeError, ValueError) as e:
            raise TargetError(f"{key}: the {which} set from {target} has items of different shapes or types "
                              f"({e})") from None
    if len(x) == 0:
        raise TargetError(f"{key}: the {which} set from {target} is empty (length 0)")
    return x, y


def user_datasets(target: str, kwargs: dict) -> tuple:
    """``data.target`` called with ``data.kwargs``: its (train, test[, validation]) datasets."""
    out = _call(load_target(target, "data.target"), target, "data.target", kwargs)
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise TargetError(f"data.target: {target} must return (train, test) or (train, test, validation) "
                          f"datasets, got {type(out).__name__}")
    for d, w in zip(out, ("training", "test", "validation")):
        try:
            n = len(d)
        except TypeError:
            raise TargetError(f"data.target: the {w} set from {target} is a {type(d).__name__}, not a map-style "
                              f"torch Dataset (it has no len())") from None
        if n == 0:
            raise TargetError(f"data.target: the {w} set from {target} is empty (length 0)")
    return tuple(out)


def load_user_dataset(target: str, kwargs: dict, parts: Optional[tuple] = None):
    """``data.target`` -> our in-memory Dataset (data.py), with no normalisation statistics.
    ``parts``: the datasets ``user_datasets`` returned, when already made."""
    from .data import Dataset
    out = user_datasets(target, kwargs) if parts is None else parts
    parts = [_stack(d, w, target) for d, w in zip(out, ("training", "test", "validation"))]
    (xtr, ytr), (xte, yte) = parts[0], parts[1]
    xv, yv = parts[2] if len(parts) == 3 else (None, None)
    ncls = int(ytr.max()) + 1 if not ytr.is_floating_point() else 0
    return Dataset(f"target:{target}", xtr, ytr, xte, yte, ncls, None, None, xv, yv)


# --------------------------------------------------------------------------- loss and metric
def cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the last dimension of ``out`` (classes or a vocabulary); a
    sequence's every position counts as one prediction."""
    if out.dim() > 2:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction=reduction)
    return F.cross_entropy(out, y, reduction=reduction)


@dataclass
class Objective:
    """What a run optimises and reports: ``loss(out, y)`` (a scalar mean), and for
    evaluation ``sums(out, y)`` = [metric sum, loss sum, count] over a batch, whose ratios
    are the metric and the mean loss. ``metric`` names it (accuracy, loss, perplexity, or
    the target's name); ``higher_is_better`` says which way it goes."""
    loss: Callable
    metric: str
    metric_fn: Optional[Callable]
    builtin_loss: bool

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    def sums(self, out: torch.Tensor, y: torch.Tensor) -> list:
        if self.builtin_loss:              # per prediction (per token for a sequence), summed exactly
            loss_sum, count = float(cross_entropy(out, y, reduction="sum")), float(y.numel())
        else:                              # the user's batch mean, weighted by the batch's examples
            count = float(len(y))
            loss_sum = float(self.loss(out, y)) * count
        if self.metric_fn is not None:     # the user's: a batch mean, weighted as the loss is
            m = float(self.metric_fn(out, y)) * count
        elif self.metric == "accuracy":
            m = float((out.argmax(-1) == y).sum())
            if not self.builtin_loss:      # counted per example then: accuracy per prediction, scaled
                m = m * count / max(1, y.numel())
        else:                              # loss, perplexity
            m = loss_sum
        return [m, loss_sum, count]

    def finish(self, metric_sum: float, count: float) -> float:
        v = metric_sum / count
        return math.exp(min(v, 700.0)) if self.metric == "perplexity" else v


def objective(loss: str = "cross_entropy", metric: str = "accuracy") -> Objective:
    lf = cross_entropy if loss == "cross_entropy" else load_target(loss, "train.loss")
    if metric in ("accuracy", "loss", "perplexity"):
        return Objective(lf, metric, None, loss == "cross_entropy")
    fn = load_target(metric, "eval.metric")
    name = metric.rpartition(":")[2]
    if name in ("accuracy", "loss", "perplexity", "error"):     # its figures would overwrite the built-in ones
        raise TargetError(f"eval.metric: {metric}: a function of your own may not be named {name} (the built-in "
                          f"metric's name); rename it")
    return Objective(lf, name, fn, loss == "cross_entropy")


def check_loss(obj: Objective, model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: str,
               model_key: str = "model.target") -> None:
    """One forward pass and the loss on a couple of training examples: it must be a scalar
    tensor that backpropagates (checked before any collective, on every rank alike)."""
    try:
        out = model(x)
    except Exception as e:
        raise TargetError(f"{model_key}: the model's forward pass on the data's inputs of shape {tuple(x.shape[1:])} "
                          f"raised {type(e).__name__}: {e}") from None
    try:
        val = obj.loss(out, y)
    except Exception as e:
        raise TargetError(f"train.loss: {spec} on the model's output raised {type(e).__name__}: {e}") from None
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        raise TargetError(f"train.loss: {spec} must return a scalar tensor, got {shape}")
    if not val.requires_grad:
        raise TargetError(f"train.loss: {spec} returned a tensor that does not depend on the model's parameters")
    if obj.metric_fn is not None:
        try:
            m = obj.metric_fn(out.detach(), y)
            float(m)
        except Exception as e:
            raise TargetError(f"eval.metric: {obj.metric} must return a number for a batch "
                              f"({type(e).__name__}: {e})") from None
