"""Model variants that only the paper's ablations use, built as BlockNets so split/describe apply."""

from __future__ import annotations

from torch import nn

from fedper.models import BlockNet, build_model

LINEAR_BASE_FEATURES = 512  # at width 1.0


def linear_base(num_classes: int, width: float = 1.0, input_size: int = 32) -> BlockNet:
    """Figures 5-6: the whole base is one linear layer on the pixels (+ ReLU); with K_P=1 the head
    is the classifier. The block ends as a 1x1 map so BlockNet's pooling is the identity."""
    features = max(8, int(LINEAR_BASE_FEATURES * width))
    block = nn.Sequential(
        nn.Flatten(), nn.Linear(3 * input_size * input_size, features), nn.ReLU(inplace=True),
        nn.Unflatten(1, (features, 1, 1)),
    )
    return BlockNet(nn.Identity(), [block], features, num_classes)


VARIANTS = {"linear_base": linear_base}


def build(architecture: str, num_classes: int, width: float, input_size: int) -> BlockNet:
    """fedper.models.build_model, plus the ablation variants above."""
    if architecture in VARIANTS:
        return VARIANTS[architecture](num_classes, width, input_size)
    return build_model(architecture, num_classes, width, input_size)
