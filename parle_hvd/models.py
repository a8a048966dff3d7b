"""Networks. Nothing here imports anything distributed.

Channels, classes and input size follow the dataset (``build_model(..., in_channels,
image_size)``). Parameter counts are pinned in tests/test_models.py."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class LeNet(nn.Module):
    """The LeNet of the Parle / Entropy-SGD authors' code (ucla-vision/entropy-sgd,
    models.py, used for the paper's MNIST runs): two conv-BN-ReLU-maxpool-dropout blocks
    (20 and 50 channels, 5x5 kernels, pools 3 and 2), a 500-unit BN-ReLU-dropout hidden
    layer, and a linear classifier; dropout 0.25. On 28x28 inputs the flattened feature
    is 50x2x2; other sizes are measured at construction."""

    default_dropout = 0.25

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28, dropout: float = 0.25):
        super().__init__()

        def block(ci, co, k, pool):
            return nn.Sequential(nn.Conv2d(ci, co, k), nn.BatchNorm2d(co), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(pool, stride=pool), nn.Dropout(dropout))

        self.features = nn.Sequential(block(in_channels, 20, 5, 3), block(20, 50, 5, 2))
        with torch.no_grad():
            flat = self.features(torch.zeros(2, in_channels, image_size, image_size)).flatten(1).shape[1]
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, 500), nn.BatchNorm1d(500), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(500, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class AllCNNC(nn.Module):
    """All-CNN-C (Springenberg et al. 2015) with BatchNorm, as in the authors' code: input
    dropout 0.2, nine convolutions (96, 96, 96/2, 192, 192, 192/2, 192, 192 1x1, classes
    1x1) each followed by ReLU and BatchNorm, dropout (0.5, the paper's) after each
    stride-2 stage, global average pooling. About 1.37 M parameters for CIFAR-10."""

    default_dropout = 0.5

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, dropout: float = 0.5,
                 c1: int = 96, c2: int = 192):
        super().__init__()

        def cbr(ci, co, k, s=1, p=0):
            return [nn.Conv2d(ci, co, k, stride=s, padding=p), nn.ReLU(inplace=True), nn.BatchNorm2d(co)]

        self.net = nn.Sequential(
            nn.Dropout(0.2),
            *cbr(in_channels, c1, 3, 1, 1), *cbr(c1, c1, 3, 1, 1), *cbr(c1, c1, 3, 2, 1), nn.Dropout(dropout),
            *cbr(c1, c2, 3, 1, 1), *cbr(c2, c2, 3, 1, 1), *cbr(c2, c2, 3, 2, 1), nn.Dropout(dropout),
            *cbr(c2, c2, 3, 1, 1), *cbr(c2, c2, 1, 1, 0), *cbr(c2, num_classes, 1, 1, 0),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.net(x)


class _WideBlock(nn.Module):
    """Pre-activation wide basic block: BN-ReLU-conv3x3-(dropout)-BN-ReLU-conv3x3, plus a
    1x1 projection shortcut when the shape changes."""

    def __init__(self, ci, co, stride, dropout):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(ci), nn.Conv2d(ci, co, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(co), nn.Conv2d(co, co, 3, 1, 1, bias=False)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.short = None if (ci == co and stride == 1) else nn.Conv2d(ci, co, 1, stride, 0, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(F.relu(self.bn2(self.drop(y))))
        return y + (x if self.short is None else self.short(o))


class WideResNet(nn.Module):
    """WRN-d-k (Zagoruyko & Komodakis 2016), pre-activation: widths 16, 16k, 32k, 64k,
    (d-4)/6 blocks per group. WRN-28-10 has about 36.5 M parameters."""

    default_dropout = 0.0

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, dropout: float = 0.0,
                 depth: int = 28, width: int = 10):
        super().__init__()
        n = (depth - 4) // 6
        w = [16, 16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(in_channels, w[0], 3, 1, 1, bias=False)
        layers = []
        for g, stride in zip(range(3), (1, 2, 2)):
            for i in range(n):
                layers.append(_WideBlock(w[g] if i == 0 else w[g + 1], w[g + 1], stride if i == 0 else 1, dropout))
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(w[3])
        self.fc = nn.Linear(w[3], num_classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


class _BasicBlock(nn.Module):
    def __init__(self, ci, co, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(ci, co, 3, stride, 1, bias=False), nn.BatchNorm2d(co)
        self.conv2, self.bn2 = nn.Conv2d(co, co, 3, 1, 1, bias=False), nn.BatchNorm2d(co)
        self.short = nn.Sequential()
        if stride != 1 or ci != co:
            self.short = nn.Sequential(nn.Conv2d(ci, co, 1, stride, bias=False), nn.BatchNorm2d(co))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs: 3x3 stem without max-pool, four stages of two basic
    blocks (64, 128, 256, 512). About 11.2 M parameters."""

    default_dropout = 0.0

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        layers, ci = [], 64
        for co, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_BasicBlock(ci, co, stride), _BasicBlock(co, co, 1)]
            ci = co
        self.layers = nn.Sequential(*layers)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1)
        return self.fc(self.drop(x))


MODELS = {"lenet": LeNet, "allcnn": AllCNNC, "wrn": WideResNet, "resnet18": ResNet18}


def build_model(name: str, *, num_classes: int, in_channels: int, image_size: int = 28, dropout: float = -1.0,
                depth: int = 28, width: int = 10) -> nn.Module:
    cls = MODELS[name]
    kw = dict(num_classes=num_classes, in_channels=in_channels, image_size=image_size,
              dropout=cls.default_dropout if dropout < 0 else dropout)
    if cls is WideResNet:
        kw.update(depth=depth, width=width)
    return cls(**kw)


def sync_tensors(model: nn.Module) -> list:
    """What the reference averages: every parameter and every floating-point buffer
    (BatchNorm running mean/var). Integer buffers (num_batches_tracked) are equal on all
    replicas and are left alone."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
