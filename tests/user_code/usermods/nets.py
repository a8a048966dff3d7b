"""A user's model: nothing in it knows parle_hvd."""
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_dim: int = 8, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def make_mlp(in_dim: int = 8, hidden: int = 32, classes: int = 4) -> nn.Module:
    return MLP(in_dim, hidden, classes)


def not_a_module(**kwargs):
    return {"weights": 1}


def raises(**kwargs):
    raise RuntimeError("no GPU named gpu7")


NOT_CALLABLE = 3
