"""A CIFAR-style ResNet-20 (He et al. 2016, §4.2) for tests and benchmarks.

Attribute names follow torchvision (``conv1, bn1, relu, layer1..layer3,
avgpool, fc``) so :func:`actcache_client.layouts._stages.from_resnet` splits it into
a stem, one stage per residual block, and a head.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actcache.errors import ConfigError

__all__ = ["BasicBlock", "CifarResNet", "resnet20"]

Shortcut = Literal["A", "B"]


class _PadShortcut(nn.Module):
    """Option A: subsample by ``stride`` and zero-pad the extra channels (no parameters)."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = planes - in_planes

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.pad // 2
        return F.pad(x, (0, 0, 0, 0, half, self.pad - half))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus a shortcut: option "A" (pad) or "B" (1x1 conv + BN)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1, shortcut: Shortcut = "A") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            if shortcut == "A":
                self.shortcut = _PadShortcut(in_planes, planes, stride)
            elif shortcut == "B":
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
                )
            else:
                raise ConfigError(f"shortcut must be 'A' (zero-pad) or 'B' (1x1 conv), got {shortcut!r}; "
                                  "pass shortcut='A' or 'B'")

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 inputs: 16/32/64 channels, ``n`` blocks per layer."""

    def __init__(self, blocks_per_layer: int, num_classes: int = 10, shortcut: Shortcut = "A") -> None:
        super().__init__()
        if blocks_per_layer < 1:
            raise ConfigError(f"blocks_per_layer must be >= 1 (ResNet-20: 3), got {blocks_per_layer}")
        self.conv1 = nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.layer1 = self._make_layer(16, 16, blocks_per_layer, 1, shortcut)
        self.layer2 = self._make_layer(16, 32, blocks_per_layer, 2, shortcut)
        self.layer3 = self._make_layer(32, 64, blocks_per_layer, 2, shortcut)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    @staticmethod
    def _make_layer(in_planes: int, planes: int, n: int, stride: int, shortcut: Shortcut) -> nn.Sequential:
        blocks = [BasicBlock(in_planes, planes, stride, shortcut)]
        blocks += [BasicBlock(planes, planes, 1, shortcut) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet20(num_classes: int = 10, shortcut: Shortcut = "A") -> CifarResNet:
    """ResNet-20 (3 blocks per layer, ~0.27 M parameters with option A)."""
    return CifarResNet(3, num_classes, shortcut)
