"""The one network shape every model here has: stem, ordered basic blocks, pooling, classifier.

FedPer's K_P counts basic blocks from the output, so a model that exposes its blocks in order is
all that `split` needs; no per-model split code.
"""

from __future__ import annotations

from torch import Tensor, nn


class BlockNet(nn.Module):
    """stem -> blocks[0..n-1] -> adaptive average pool -> classifier.

    Global pooling is adaptive, so 32x32 and 224x224 inputs both work without resizing.
    """

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], features: int, num_classes: int) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(features, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.pool(self.blocks(self.stem(x))).flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
