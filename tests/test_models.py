"""Models and the K_P split: exact counts computed independently of models/, shapes, errors."""

from __future__ import annotations

import pytest
import torch
import torchvision

from fedper.models import MAX_KP, build_model, split

# MobileNet-v1's 13 blocks (output channels at width 1.0), from Howard et al. 2017, Table 1.
MOBILENET_CHANNELS = [64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024]


def mobilenet_counts(width: float, num_classes: int) -> tuple[int, list[int], int]:
    """Parameter counts of (stem, each block, classifier), from the architecture's definition."""

    def ch(c: int) -> int:
        return max(8, int(c * width))

    cin = ch(32)
    stem = 3 * 3 * 3 * cin + 2 * cin
    blocks = []
    for c in MOBILENET_CHANNELS:
        cout = ch(c)
        blocks.append(9 * cin + 2 * cin + cin * cout + 2 * cout)  # depthwise + BN, pointwise + BN
        cin = cout
    return stem, blocks, cin * num_classes + num_classes


def param_count(model: torch.nn.Module, names: tuple[str, ...]) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in names if n in params)


@pytest.mark.parametrize("width", [1.0, 0.25])
@pytest.mark.parametrize("kp", range(MAX_KP + 1))
def test_mobilenet_split_counts(width: float, kp: int) -> None:
    model = build_model("mobilenet_v1", 10, width=width, input_size=32)
    stem, blocks, classifier = mobilenet_counts(width, 10)
    head = 0 if kp == 0 else classifier + sum(blocks[len(blocks) - (kp - 1):])
    total = stem + sum(blocks) + classifier
    parts = split(model, kp)
    assert param_count(model, parts.head) == head
    assert param_count(model, parts.base) == total - head
    assert set(parts.base).isdisjoint(parts.head)
    assert set(parts.base) | set(parts.head) == set(model.state_dict())


@pytest.mark.parametrize("kp", range(MAX_KP + 1))
def test_resnet34_split_counts_match_torchvision(kp: int) -> None:
    """At width 1.0 with the ImageNet stem, the model is torchvision's resnet34 with other names."""
    reference = torchvision.models.resnet34(num_classes=100)
    last_blocks = [reference.layer4[2], reference.layer4[1], reference.layer4[0]]
    head_modules = [] if kp == 0 else [reference.fc, *last_blocks[: kp - 1]]
    expected_head = sum(p.numel() for m in head_modules for p in m.parameters())
    expected_total = sum(p.numel() for p in reference.parameters())

    model = build_model("resnet34", 100, input_size=224)
    parts = split(model, kp)
    assert param_count(model, parts.head) == expected_head
    assert param_count(model, parts.base) == expected_total - expected_head


def test_resnet34_cifar_stem_is_a_3x3_conv_without_maxpool() -> None:
    reference_total = sum(p.numel() for p in torchvision.models.resnet34(num_classes=10).parameters())
    model = build_model("resnet34", 10, input_size=32)
    assert sum(p.numel() for p in model.parameters()) == reference_total - 3 * 64 * 49 + 3 * 64 * 9
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.stem)


def test_batchnorm_buffers_follow_their_layer() -> None:
    model = build_model("mobilenet_v1", 10, width=0.25, input_size=32)
    parts = split(model, 2)
    assert "blocks.12.4.running_var" in parts.head
    assert "blocks.11.4.running_var" in parts.base
    assert parts.role("classifier.weight") == "head"


@pytest.mark.parametrize("arch", ["mobilenet_v1", "resnet34"])
@pytest.mark.parametrize("size", [32, 224])
def test_forward_shapes_at_both_input_sizes(arch: str, size: int) -> None:
    model = build_model(arch, 7, width=1.0, input_size=size).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, 7)


def test_adaptive_pooling_accepts_other_sizes() -> None:
    model = build_model("mobilenet_v1", 3, width=0.25, input_size=32).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 40)).shape == (1, 3)


@pytest.mark.parametrize("kp", [-1, 5, 2.0, None])
def test_kp_out_of_range_is_a_clear_error(kp: object) -> None:
    model = build_model("mobilenet_v1", 10, width=0.25)
    with pytest.raises(ValueError, match=r"K_P must be an integer in 0\.\.4"):
        split(model, kp)  # type: ignore[arg-type]


def test_unknown_model_and_bad_width() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg", 10)
    with pytest.raises(ValueError, match="width multiplier must be > 0"):
        build_model("mobilenet_v1", 10, width=0)
