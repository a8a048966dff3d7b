"""Networks. Nothing here imports anything distributed."""
from __future__ import annotations

import torch
from torch import nn


class LeNet(nn.Module):
    """The LeNet of the Parle / Entropy-SGD authors' code (ucla-vision/entropy-sgd,
    models.py, used for the paper's MNIST runs): two conv-BN-ReLU-maxpool-dropout blocks
    (20 and 50 channels, 5x5 kernels, pools 3 and 2), a 500-unit BN-ReLU-dropout hidden
    layer, and a linear classifier; dropout 0.25. 28x28 inputs."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, dropout: float = 0.25):
        super().__init__()

        def block(ci, co, k, pool):
            return nn.Sequential(nn.Conv2d(ci, co, k), nn.BatchNorm2d(co), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(pool, stride=pool), nn.Dropout(dropout))

        self.features = nn.Sequential(block(in_channels, 20, 5, 3), block(20, 50, 5, 2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(50 * 2 * 2, 500), nn.BatchNorm1d(500), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(500, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


MODELS = {"lenet": LeNet}


def build_model(name: str, *, num_classes: int, in_channels: int, dropout: float) -> nn.Module:
    return MODELS[name](num_classes=num_classes, in_channels=in_channels, dropout=dropout)


def sync_tensors(model: nn.Module) -> list:
    """What the reference averages: every parameter and every floating-point buffer
    (BatchNorm running mean/var). Integer buffers (num_batches_tracked) are equal on all
    replicas and are left alone."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
