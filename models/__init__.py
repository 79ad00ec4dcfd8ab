"""Models as ordered basic blocks + classifier, and the base/head split (K_P)."""

from __future__ import annotations

from typing import Literal

from fedper.models.blocknet import BlockNet
from fedper.models.describe import IMAGENET_MEAN, IMAGENET_STD, describe, exported_state
from fedper.models.mobilenet_v1 import mobilenet_v1
from fedper.models.resnet import resnet34
from fedper.models.split import MAX_KP, Split, split

ARCHITECTURES = ("mobilenet_v1", "resnet34")
Architecture = Literal["mobilenet_v1", "resnet34"]


def build_model(
    architecture: str, num_classes: int, width: float = 1.0, input_size: int = 32
) -> BlockNet:
    """Build by name. Inputs of 64 pixels or less get the small-input (CIFAR) stem."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    small = input_size <= 64
    if architecture == "mobilenet_v1":
        return mobilenet_v1(num_classes, width, small_input=small)
    if architecture == "resnet34":
        return resnet34(num_classes, width, cifar_stem=small)
    raise ValueError(f"unknown model {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")


__all__ = [
    "ARCHITECTURES", "IMAGENET_MEAN", "IMAGENET_STD", "MAX_KP", "Architecture", "BlockNet", "Split",
    "build_model", "describe", "exported_state", "split",
]
