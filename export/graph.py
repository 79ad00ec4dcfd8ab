"""`--graph fast`: the same model, exported as ops that onnxruntime-training 1.19 trains faster on CPU.

Two rewrites of the module tree, applied to the exporter's private copy just before torch.onnx
traces it; every weight stays the same Parameter under the same name, so the manifest, the
checkpoints and the wire do not change, only the graph's ops (benchmarks/depthwise_graph.py, and
docs/performance.md section 1, measured them):

- A 3x3 depthwise convolution on a map of at most MAX_SIDE x MAX_SIDE pixels becomes one MatMul
  batched over channels against per-channel Toeplitz matrices built from the weight. ORT's CPU
  Conv/ConvGrad run a depthwise convolution as an im2col + GEMM per group (channel), and that
  per-group overhead dominates where maps are small and channels many. Larger maps keep the Conv:
  the matrices grow with the square of the map (memory), and the gain did not grow with them.
- Every ReLU becomes Clip(min=0): ORT's ReluGrad is single-threaded, Clip's gradient is built
  from multi-threaded elementwise ops. Its gradient at exactly 0 is 1 (ReluGrad: 0); at a
  measure-zero set of inputs that is what PyTorch's clamp does too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GRAPHS = ("stock", "fast")
MAX_SIDE = 8  # largest input map (pixels per side) whose depthwise convolution becomes a MatMul


def tap_matrix(height: int, width: int, stride: int) -> tuple[torch.Tensor, int, int]:
    """(P, Ho, Wo): P [9, Ho*Wo * H*W] with P[t, o*H*W + k] = 1 where input pixel k is tap t of output o."""
    out_h, out_w = (height - 1) // stride + 1, (width - 1) // stride + 1
    taps = np.zeros((9, out_h * out_w, height * width), np.float32)
    oh, ow = np.meshgrid(np.arange(out_h), np.arange(out_w), indexing="ij")
    for i in range(3):
        for j in range(3):
            h, w = oh * stride + i - 1, ow * stride + j - 1
            inside = (h >= 0) & (h < height) & (w >= 0) & (w < width)
            taps[i * 3 + j, (oh * out_w + ow)[inside], (h * width + w)[inside]] = 1
    return torch.from_numpy(taps.reshape(9, -1)), out_h, out_w


class ToeplitzDepthwise(nn.Module):
    """A 3x3, padding-1 depthwise convolution on an HxW map as one MatMul batched over channels.

    The weight is scattered into per-channel [Ho*Wo, H*W] matrices through the constant `taps`
    (a plain attribute, so the ONNX export inlines it as a Constant, not an initializer). They are
    the MatMul's first operand: as the second, constant-folded in an inference session, ORT 1.19's
    MatMul+BatchNormalization fusion takes them for a 2-D weight and fails to load the model.
    """

    def __init__(self, conv: nn.Conv2d, height: int, width: int) -> None:
        super().__init__()
        self.weight = conv.weight  # the same Parameter: same state_dict name, shape and value
        self.channels, self.pixels = conv.in_channels, height * width
        self.taps, self.out_h, self.out_w = tap_matrix(height, width, conv.stride[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, k, o = self.channels, self.pixels, self.out_h * self.out_w
        per_channel = (self.weight.reshape(c, 9) @ self.taps).reshape(c, o, k)
        by_channel = x.reshape(-1, c, k).permute(1, 2, 0)  # [C, H*W, N]
        return torch.matmul(per_channel, by_channel).permute(2, 0, 1).reshape(-1, c, self.out_h, self.out_w)


class ClipReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, min=0.0)


def depthwise_layers(model: nn.Module, input_size: int) -> dict[str, tuple[nn.Conv2d, int, int]]:
    """{module path: (conv, input height, input width)} of every 3x3, padding-1, bias-free depthwise conv."""
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels == m.out_channels
             and m.kernel_size == (3, 3) and m.padding == (1, 1) and m.dilation == (1, 1) and m.bias is None}
    shapes: dict[str, tuple[int, int]] = {}
    hooks = [m.register_forward_hook(lambda _m, args, _out, name=name: shapes.__setitem__(name, args[0].shape[2:]))
             for name, m in found.items()]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, input_size, input_size))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return {name: (conv, *shapes[name]) for name, conv in found.items()}


def replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def rewrite_fast(model: nn.Module, input_size: int, max_side: int = MAX_SIDE) -> None:
    """Apply both rewrites to `model` in place."""
    for path, (conv, height, width) in depthwise_layers(model, input_size).items():
        if max(height, width) <= max_side:
            replace(model, path, ToeplitzDepthwise(conv, height, width))
    for path, module in list(model.named_modules()):
        if isinstance(module, nn.ReLU):
            replace(model, path, ClipReLU())
