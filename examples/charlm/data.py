"""The corpus: the Python Language Reference as CPython ships it (pydoc_data.topics, about
465 000 characters of English prose and code in every CPython install; nothing downloaded),
read character by character.

The text is cut into three contiguous parts (train, validation, test: 90/5/5 %), each into
non-overlapping windows of block_size + 1 characters: the input is the first block_size,
the target the same shifted by one (next-character prediction)."""
import torch
from torch.utils.data import TensorDataset


def corpus() -> str:
    import pydoc_data.topics as t
    return "\n\n".join(t.topics[k] for k in sorted(t.topics))


def vocab() -> list:
    return sorted(set(corpus()))


def _windows(ids: torch.Tensor, block_size: int) -> TensorDataset:
    n = (len(ids) - 1) // block_size
    x = ids[: n * block_size].view(n, block_size)
    y = ids[1: n * block_size + 1].view(n, block_size)
    return TensorDataset(x.clone(), y.clone())


def make(block_size: int = 64, val_frac: float = 0.05, test_frac: float = 0.05):
    text = corpus()
    idx = {c: i for i, c in enumerate(vocab())}
    ids = torch.tensor([idx[c] for c in text], dtype=torch.int64)
    n_val, n_test = int(len(ids) * val_frac), int(len(ids) * test_frac)
    train, val, test = ids[: -(n_val + n_test)], ids[-(n_val + n_test): -n_test], ids[-n_test:]
    return _windows(train, block_size), _windows(test, block_size), _windows(val, block_size)
