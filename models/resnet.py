"""ResNet-34 built from torchvision's BasicBlock, as a BlockNet of its 16 basic blocks.

At width 1.0 without the CIFAR stem it has exactly torchvision.models.resnet34's layers and
parameter count; only the parameter names differ (stem.*, blocks.i.*, classifier.*).
"""

from __future__ import annotations

from torch import nn

from fedper.models.blocknet import BlockNet

# (blocks, planes at width 1.0, first stride) of ResNet-34's four stages.
STAGES: tuple[tuple[int, int, int], ...] = ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2))


def resnet34(num_classes: int, width: float = 1.0, cifar_stem: bool = False) -> BlockNet:
    """`cifar_stem`: a 3x3 stride-1 stem conv and no max-pool, the usual ResNet for 32x32 inputs."""
    if width <= 0:
        raise ValueError(f"width multiplier must be > 0, got {width}")
    from torchvision.models.resnet import BasicBlock  # importing torchvision costs ~2 s of CPU: only a ResNet needs it

    inplanes = max(8, int(64 * width))
    if cifar_stem:
        stem = nn.Sequential(
            nn.Conv2d(3, inplanes, 3, 1, 1, bias=False), nn.BatchNorm2d(inplanes), nn.ReLU(inplace=True)
        )
    else:
        stem = nn.Sequential(
            nn.Conv2d(3, inplanes, 7, 2, 3, bias=False),
            nn.BatchNorm2d(inplanes),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
    blocks: list[nn.Module] = []
    for count, planes_at_1, first_stride in STAGES:
        planes = max(8, int(planes_at_1 * width))
        for i in range(count):
            stride = first_stride if i == 0 else 1
            downsample = None
            if stride != 1 or inplanes != planes:
                downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
            blocks.append(BasicBlock(inplanes, planes, stride, downsample))
            inplanes = planes
    return BlockNet(stem, blocks, inplanes, num_classes)
