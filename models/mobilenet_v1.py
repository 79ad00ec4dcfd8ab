"""MobileNet-v1 (Howard et al. 2017) with a width multiplier, as a BlockNet of 13 blocks."""

from __future__ import annotations

from torch import nn

from fedper.models.blocknet import BlockNet

# (output channels at width 1.0, stride) of the 13 depthwise-separable blocks, from the paper's Table 1.
BLOCKS: tuple[tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1),
)
STEM_CHANNELS = 32


def scaled(channels: int, width: float) -> int:
    """Channels at width multiplier `width`, never below 8 so tiny test models stay valid."""
    return max(8, int(channels * width))


def conv_bn_relu(cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


class DepthwiseSeparable(nn.Sequential):
    """3x3 depthwise conv + BN + ReLU, then 1x1 pointwise conv + BN + ReLU: one basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__(*conv_bn_relu(cin, cin, 3, stride, groups=cin), *conv_bn_relu(cin, cout, 1, 1))


def mobilenet_v1(num_classes: int, width: float = 1.0, small_input: bool = False) -> BlockNet:
    """`small_input` (32x32, CIFAR) keeps the stem at stride 1 so the last block still sees 2x2 maps."""
    if width <= 0:
        raise ValueError(f"width multiplier must be > 0, got {width}")
    cin = scaled(STEM_CHANNELS, width)
    stem = nn.Sequential(*conv_bn_relu(3, cin, 3, 1 if small_input else 2))
    blocks: list[nn.Module] = []
    for channels, stride in BLOCKS:
        cout = scaled(channels, width)
        blocks.append(DepthwiseSeparable(cin, cout, stride))
        cin = cout
    return BlockNet(stem, blocks, cin, num_classes)
