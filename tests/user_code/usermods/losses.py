"""A user's losses."""
import torch.nn.functional as F


def smoothed_ce(out, y):
    return F.cross_entropy(out, y, label_smoothing=0.05)


def per_example(out, y):          # a mistake: not reduced to a scalar
    return F.cross_entropy(out, y, reduction="none")


def top2(out, y):                 # a metric: the fraction of examples whose class is in the top 2
    return (out.topk(2, dim=-1).indices == y[:, None]).any(-1).float().mean()


def accuracy(out, y):             # a mistake: the built-in metric's name
    return (out.argmax(-1) == y).float().mean()
