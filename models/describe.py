"""Write a model's split down as a Manifest: the only bridge from torch modules to the contract."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedper.algorithms import check_kp, get_algorithm
from fedper.manifest import Manifest, ModelInfo, TensorSpec, check_bn, is_shared
from fedper.models.blocknet import BlockNet
from fedper.models.split import split

# ImageNet statistics: the normalization the agent applies to uint8 images before the model sees them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def exported_state(model: BlockNet) -> dict[str, torch.Tensor]:
    """state_dict without BatchNorm's num_batches_tracked: a PyTorch counter that no ONNX graph uses."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def batchnorm_names(model: BlockNet) -> frozenset[str]:
    """The exported_state names of every BatchNorm layer's tensors (affine parameters and running statistics)."""
    return frozenset(
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        if name != "num_batches_tracked"
    )


def describe(
    model: BlockNet,
    *,
    architecture: str,
    kp: int,
    algorithm: str,
    input_size: int,
    width: float = 1.0,
    classes: Sequence[str] = (),
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    bn: str = "shared",
) -> Manifest:
    """`bn`: the BatchNorm policy (fedper.manifest.BN_POLICIES); "local" marks every BatchNorm tensor not shared."""
    check_kp(get_algorithm(algorithm), kp)
    check_bn(bn)
    parts = split(model, kp)
    batchnorm = batchnorm_names(model)
    trainable = {name for name, _ in model.named_parameters()}
    tensors = tuple(
        TensorSpec(
            name=name,
            shape=tuple(value.shape),
            dtype=str(value.detach().cpu().numpy().dtype),
            role=parts.role(name),
            trainable=name in trainable,
            shared=is_shared(parts.role(name), algorithm, batchnorm=name in batchnorm, bn=bn),
            batchnorm=name in batchnorm,
        )
        for name, value in exported_state(model).items()
    )
    num_classes = model.classifier.out_features
    if classes and len(classes) != num_classes:
        raise ValueError(f"{len(classes)} class names for a model with {num_classes} outputs")
    info = ModelInfo(
        architecture=architecture,
        kp=kp,
        num_classes=num_classes,
        input_shape=(3, input_size, input_size),
        mean=tuple(mean),
        std=tuple(std),
        width=width,
        classes=tuple(classes),
    )
    return Manifest(model=info, algorithm=algorithm, tensors=tensors, versions=_versions(), bn=bn)


def _versions() -> dict[str, str]:
    """The libraries that wrote the manifest; onnxruntime only where it is installed (the emulator runs without)."""
    import onnx

    versions = {"torch": torch.__version__, "onnx": onnx.__version__}
    try:
        import onnxruntime
    except ImportError:
        return versions
    return {**versions, "onnxruntime": onnxruntime.__version__}
