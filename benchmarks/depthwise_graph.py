"""Experiment: MobileNet-v1's 3x3 depthwise convolution exported as other standard ops. Does ORT train faster?

onnxruntime-training 1.19's CPU Conv/ConvGrad run a depthwise convolution (group = channels) as
im2col + one small GEMM per image and group: the per-group overhead, not the FLOPs, is what costs,
and most of all where maps are small and channels many. Each variant swaps every qualifying
`nn.Conv2d(groups=C)` for a module that holds the *same* weight Parameter ([C, 1, 3, 3], same
name), so the manifest's tensors and the checkpoint do not change; only the graph does:

- `taps`: pad once, then the sum over the 9 taps of a (strided) slice of the padded input times
  that tap's weight reshaped to [1, C, 1, 1] (Pad, Slice, Mul, Add; stride 2 by slice steps).
- `toeplitz<=N`: for layers whose input map is at most NxN, the convolution as one batched MatMul
  over channels: M_c = sum_t w[c, t] P_t (P: a constant 0/1 tap-placement matrix, [9, HW*HoWo]),
  y[:, c] = x[:, c] (flattened) @ M_c, with x transposed to [C, B, HW]; larger maps keep the Conv.
- `+clip`: every ReLU as Clip(min=0) (ORT's gradient: GreaterOrEqual, Cast, Mul: multi-threaded
  elementwise ops instead of the single-threaded ReluGrad).
- `fast`: toeplitz<=8 + clip, as `fedper-export --graph fast` writes it (fedper.export.graph, whose
  modules the other variants use too).

Stock and fast are exported by the project's own `export_artifacts`, the others by the
exporter's own steps (torch_to_onnx, write_artifact_set) on its seeded model with the modules
swapped in. Each is checked layer by layer against nn.Conv2d (1e-5), checked for one ORT training
step against the stock export from the same weights and batch (loss, every updated tensor and the
eval loss within 1e-4) and against PyTorch's step in float64 (is the variant as close to the exact
step as the stock export is?), then timed in the agent's training loop (OrtBackend) against
PyTorch eager on the stock model, interleaved repeats, medians of per-repeat ratios. Last, ORT's
profile of the stock export and of the fastest variant, by op type.

    python benchmarks/depthwise_graph.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from common import main, median, table, write_json
from device_training import INPUT_SIZE, LR, NUM_CLASSES, make_data, ort_agent_rate, rate, torch_step
from torch import nn

from fedper.artifacts import artifact_sets_for
from fedper.edge.ort_backend import OrtBackend
from fedper.export.exporter import export_artifacts
from fedper.export.graph import GRAPHS, MAX_SIDE, ClipReLU, ToeplitzDepthwise, depthwise_layers, replace
from fedper.export.onnx_export import torch_to_onnx, write_artifact_set
from fedper.manifest import Manifest
from fedper.models import build_model, describe, exported_state

ARCH = "mobilenet_v1"
ALGORITHM, SEED = "fedavg", 0  # every export: one "all" set, K_P = 0, the exporter's default seeded init
WIDTHS = (1.0, 0.5)
BATCHES = (32, 128)
FORWARD_TOL = 1e-5  # one swapped layer vs nn.Conv2d
STEP_TOL = 1e-4  # one ORT training step: variant vs stock export


# ---------------------------------------------------------------- the replacement modules


class TapsDepthwise(nn.Module):
    """3x3 depthwise conv (padding 1) as pad + sum over the 9 taps of slice * weight[c, tap]."""

    def __init__(self, conv: nn.Conv2d, height: int, width: int) -> None:
        super().__init__()
        self.weight = conv.weight  # the same Parameter: same state_dict name and shape
        self.stride = conv.stride[0]
        self.out_h, self.out_w = (height - 1) // self.stride + 1, (width - 1) // self.stride + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, ho, wo = self.stride, self.out_h, self.out_w
        padded = F.pad(x, (1, 1, 1, 1))
        out = None
        for i in range(3):
            for j in range(3):
                window = padded[:, :, i : i + s * (ho - 1) + 1 : s, j : j + s * (wo - 1) + 1 : s]
                term = window * self.weight[:, :, i, j].reshape(1, -1, 1, 1)
                out = term if out is None else out + term
        return out


# ---------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    name: str
    depthwise: str = "conv"  # "conv", "taps" or "toeplitz"
    max_side: int = 0  # toeplitz: largest input map side it replaces
    clip: bool = False


STOCK = Variant("stock")
VARIANTS = (
    STOCK,
    Variant("taps", "taps", 10_000),
    Variant("toeplitz<=8", "toeplitz", 8),
    Variant("toeplitz<=16", "toeplitz", 16),
    Variant("stock+clip", clip=True),
    Variant("toeplitz<=16+clip", "toeplitz", 16, clip=True),
    Variant("fast", "toeplitz", MAX_SIDE, clip=True),  # what `fedper-export --graph fast` writes
)
QUICK_VARIANTS = ("stock", "taps", "stock+clip", "fast")


def apply_variant(model: nn.Module, variant: Variant, input_size: int) -> list[dict[str, Any]]:
    """Swap the variant's modules into `model` in place; each swapped layer is checked against nn.Conv2d."""
    checks = []
    if variant.depthwise != "conv":
        for path, (conv, h, w) in depthwise_layers(model, input_size).items():
            if max(h, w) > variant.max_side:
                continue
            new = (TapsDepthwise if variant.depthwise == "taps" else ToeplitzDepthwise)(conv, h, w)
            x = torch.randn(4, conv.in_channels, h, w, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                err = float((new(x) - conv(x)).abs().max())
            if err > FORWARD_TOL:
                raise AssertionError(f"{variant.name} {path}: forward differs from nn.Conv2d by {err:.2e}")
            checks.append({"layer": path, "map": f"{h}x{w}", "stride": conv.stride[0], "max_abs_err": err})
            replace(model, path, new)
    if variant.clip:
        for path, m in list(model.named_modules()):
            if isinstance(m, nn.ReLU):
                replace(model, path, ClipReLU())
    return checks


def export_variant(out: Path, variant: Variant, width: float) -> tuple[Manifest, list[dict[str, Any]]]:
    """The exporter's own steps (fedper.export) on its seeded model with the variant's modules swapped in,
    writing what OrtBackend loads: the training artifact sets (the manifest is returned, not saved)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = build_model(ARCH, NUM_CLASSES, width, INPUT_SIZE)
    checks = apply_variant(model, variant, INPUT_SIZE)
    manifest = describe(model, architecture=ARCH, kp=0, algorithm=ALGORITHM, input_size=INPUT_SIZE, width=width)
    training_proto = torch_to_onnx(model, exported_state(model), manifest)
    sets = artifact_sets_for(ALGORITHM, 0)
    shutil.rmtree(out, ignore_errors=True)
    for kind, folder in sets.items():
        write_artifact_set(training_proto, manifest, kind, out / folder)
    return dataclasses.replace(manifest, artifact_sets=sets), checks


def export(cache: Path, variant: Variant, width: float) -> tuple[Path, Manifest, list[dict[str, Any]]]:
    """Stock and fast through export_artifacts as it ships; the other variants by export_variant."""
    out = cache / f"{variant.name}-w{width}".replace("<=", "le").replace("+", "_")
    if variant.name not in GRAPHS:
        return out, *export_variant(out, variant, width)
    checks: list[dict[str, Any]] = []
    if variant.name == "fast":  # the same layer checks, on a model of its own
        checks = apply_variant(build_model(ARCH, NUM_CLASSES, width, INPUT_SIZE), variant, INPUT_SIZE)
    manifest = export_artifacts(out, model=ARCH, kp=0, num_classes=NUM_CLASSES, input_size=INPUT_SIZE, width=width,
                                algorithm=ALGORITHM, seed=SEED, graph=variant.name, force=True)
    return out, manifest, checks


# ---------------------------------------------------------------- equivalence: one training step


def one_step(backend: OrtBackend, tensors: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
             ) -> tuple[float, dict[str, np.ndarray]]:
    """One ORT SGD step on (x, y) from `tensors`: (loss, every manifest tensor after it)."""
    backend.load(tensors)
    stats = backend.train("all", x, y, epochs=1, batch_size=len(y), lr=LR, seed=0)
    return stats.loss, backend.read(tensors)


def torch_one_step(width: float, tensors: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                   dtype: torch.dtype = torch.float32) -> tuple[float, dict[str, np.ndarray]]:
    """The same step in PyTorch eager on the stock model; in float64 it is the exact answer all are held to."""
    net = build_model(ARCH, NUM_CLASSES, width, INPUT_SIZE)
    net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, strict=False)
    net = net.to(dtype).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loss = F.cross_entropy(net(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state = net.state_dict()
    return float(loss.detach()), {name: state[name].detach().double().numpy() for name in tensors}


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray], skip: str = "") -> tuple[float, str]:
    diffs = {n: float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in a if not (skip and n.endswith(skip))}
    worst = max(diffs, key=diffs.__getitem__)
    return diffs[worst], worst


def step_checks(backends: dict[str, OrtBackend], width: float, batch: int = 32) -> dict[str, dict[str, Any]]:
    """From the same tensors and batch: one SGD step of every export, compared with the stock export's
    (loss, every manifest tensor, eval loss afterwards) and with PyTorch's step in float64.

    PyTorch float32 vs float64 is the float32 noise floor of this step: the stem weight's gradient,
    summed over B*32*32 positions behind 27 BatchNorms, moves by ~2e-4 with summation order alone.
    Against PyTorch, running_var is left out: ORT keeps the biased batch variance (docs/onnxruntime-training.md). A Clip
    graph's gradient at exactly 0 is 1 (ReluGrad: 0), as PyTorch's clamp's is.
    """
    stock = backends["stock"]
    start = stock.read(stock.manifest.names())
    x, y = make_data(batch, batch)
    exact_loss, exact = torch_one_step(width, start, x, y, torch.float64)
    f32_loss, f32 = torch_one_step(width, start, x, y)
    stock_loss, stock_after = one_step(stock, start, x, y)
    stock_eval = stock.evaluate(x, y)[1]
    floor, floor_tensor = max_diff(f32, exact, skip="running_var")
    result = {"PyTorch float32": {"loss_diff_vs_exact": abs(f32_loss - exact_loss), "max_tensor_diff_vs_exact": floor,
                                  "worst_tensor_vs_exact": floor_tensor}}
    stock_vs_exact = max_diff(stock_after, exact, skip="running_var")[0]
    for name, backend in backends.items():
        loss, after = (stock_loss, stock_after) if name == "stock" else one_step(backend, start, x, y)
        eval_loss = stock_eval if name == "stock" else backend.evaluate(x, y)[1]
        diff, worst = max_diff(after, stock_after)
        vs_exact, worst_exact = max_diff(after, exact, skip="running_var")
        result[name] = {
            "loss": loss, "loss_diff": abs(loss - stock_loss), "max_tensor_diff": diff, "worst_tensor": worst,
            "eval_loss_diff": abs(eval_loss - stock_eval), "loss_diff_vs_exact": abs(loss - exact_loss),
            "max_tensor_diff_vs_exact": vs_exact, "worst_tensor_vs_exact": worst_exact,
            "largest_update": max_diff(stock_after, start)[0],
            "within_1e-4": abs(loss - stock_loss) <= STEP_TOL and diff <= STEP_TOL
            and abs(eval_loss - stock_eval) <= STEP_TOL,
            "as_close_to_exact_as_stock": vs_exact <= stock_vs_exact * 1.05,
        }
    return result


# ---------------------------------------------------------------- timing


def compare(exports: dict[str, tuple[Path, Manifest]], width: float, batches, repeats: int) -> list[dict[str, Any]]:
    """samples/s of each export in the agent's loop and of PyTorch eager (stock model), interleaved."""
    backends = {name: OrtBackend(d, m) for name, (d, m) in exports.items()}
    rows = []
    for batch in batches:
        x, y = make_data(batch)
        step = torch_step(ARCH, width)
        runs: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(repeats):  # every runtime once per repeat, so all see the same background load
            for name, backend in backends.items():
                runs[name].append(ort_agent_rate(backend, x, y, batch))
            runs["torch"].append(rate(step, x, y, batch))
        for name in backends:
            ratios = [o / t for o, t in zip(runs[name], runs["torch"], strict=True)]
            vs_stock = [o / s for o, s in zip(runs[name], runs["stock"], strict=True)]
            rows.append({"width": width, "batch": batch, "variant": name, "ort_samples_s": median(runs[name]),
                         "torch_samples_s": median(runs["torch"]), "ort_over_torch": median(ratios),
                         "over_stock": median(vs_stock), "ratios": ratios})
    return rows


# ---------------------------------------------------------------- profile


def profile(directory: Path, batch: int, steps: int = 3) -> dict[str, float]:
    """ORT kernel ms per training step by op type; depthwise Conv/ConvGrad and the replacement ops apart.

    Only the training session profiles (no eval model, no optimizer: those sessions would write to the
    same file name within the same second); the optimizer step is < 1 % of a step.
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime.training import api

    d = directory / "train" / "all"
    nodes = {n.name: n for n in onnx.load(str(d / "training_model.onnx")).graph.node}
    dw_paths = {f"/{path}/" for path in _replaced_paths(nodes)}

    def label(name: str, op: str) -> str:
        node = nodes.get(name)
        if op in ("Conv", "ConvGrad") and node is not None:
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            return f"{op} {'depthwise' if group > 1 else 'dense'}"
        if any(p in name for p in dw_paths):
            return f"{op} (depthwise replacement)"
        if "/Clip" in name:
            return f"{op} (ReLU as Clip)"
        return op

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = f"{tmp}/ort"
        state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
        module = api.Module(str(d / "training_model.onnx"), state, None, device="cpu", session_options=options)
        module.train()
        x, y = make_data(batch, batch)
        for _ in range(steps + 1):
            module(x, y)
            module.lazy_reset_grad()
        del module  # the profile is written when the session goes away
        events = json.loads(next(Path(tmp).glob("ort*.json")).read_text())
    per_op: collections.Counter[str] = collections.Counter()
    runs = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_step = len(runs) // (steps + 1)
    for e in runs[per_step:]:  # the first step is a warm-up
        per_op[label(e["name"].removesuffix("_kernel_time"), e["args"]["op_name"])] += e["dur"] / 1e3 / steps
    return dict(per_op.most_common())


def _replaced_paths(nodes: dict[str, Any]) -> set[str]:
    """Module paths ("blocks.4.0") whose forward nodes are a depthwise replacement (MatMul / Slice taps)."""
    paths = set()
    for name, node in nodes.items():
        if node.op_type in ("MatMul", "Slice", "Pad") and name.startswith("/") and "_Grad" not in name:
            parts = name.strip("/").split("/")
            if len(parts) >= 2 and parts[-2].count(".") >= 2:  # "/blocks/blocks.4/blocks.4.0/MatMul"
                paths.add(parts[-2])
    return paths


# ---------------------------------------------------------------- entry points


def run(out: Path, quick: bool = False) -> str:
    variants = [v for v in VARIANTS if v.name in QUICK_VARIANTS] if quick else list(VARIANTS)
    widths, batches, repeats = ((0.5,), (32,), 1) if quick else (WIDTHS, BATCHES, 3)
    rows, checks, steps, manifests_equal, layers = [], {}, {}, {}, {}
    profiles: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        for width in widths:
            exports, stock_tensors = {}, None
            for variant in variants:
                directory, manifest, layer_checks = export(cache, variant, width)
                exports[variant.name] = (directory, manifest)
                key = f"w{width} {variant.name}"
                layers[key] = layer_checks
                checks[key] = max((c["max_abs_err"] for c in layer_checks), default=0.0)
                if stock_tensors is None:
                    stock_tensors = manifest.tensors
                manifests_equal[key] = manifest.tensors == stock_tensors
            for name, check in step_checks({n: OrtBackend(d, m) for n, (d, m) in exports.items()}, width).items():
                steps[f"w{width} {name}"] = check
                layers.setdefault(f"w{width} {name}", [])
                checks.setdefault(f"w{width} {name}", 0.0)
            rows += compare(exports, width, batches, repeats)
            if width == widths[0]:
                prof_batch = batches[-1]
                at = [r for r in rows if r["width"] == width and r["batch"] == prof_batch and r["variant"] != "stock"]
                best = max(at, key=lambda r: r["ort_over_torch"])["variant"]
                profiles = {f"stock w{width} B={prof_batch}": profile(exports["stock"][0], prof_batch),
                            f"{best} w{width} B={prof_batch}": profile(exports[best][0], prof_batch)}
    write_json(out, "depthwise_graph", {"rows": rows, "forward_max_abs_err": checks, "layers": layers,
                                        "one_step": steps, "manifest_tensors_equal": manifests_equal,
                                        "profiles_ms_per_step": profiles})
    text = table(["width", "B", "graph", "ORT samples/s", "PyTorch samples/s", "ORT / PyTorch", "x stock ORT"],
                 [[r["width"], r["batch"], r["variant"], r["ort_samples_s"], r["torch_samples_s"],
                   r["ort_over_torch"], r["over_stock"]] for r in rows])
    text += ("\n\nchecks: swapped layers' forward vs nn.Conv2d; one SGD step (B=32) from the same tensors and batch, "
             "vs the stock export (loss, every tensor, eval loss after the step) and vs PyTorch float64 "
             "(running_var left out; 'PyTorch float32' is float32's own error, the noise floor):\n")

    def cells(key: str) -> list[Any]:
        c = steps[key]
        if key.endswith("PyTorch float32"):
            return [*["-"] * 7, f"{c['max_tensor_diff_vs_exact']:.1e} ({c['worst_tensor_vs_exact']})", "-"]
        return [len(layers[key]), f"{checks[key]:.1e}", manifests_equal[key], f"{c['loss_diff']:.1e}",
                f"{c['max_tensor_diff']:.1e} ({c['worst_tensor']})", f"{c['eval_loss_diff']:.1e}", c["within_1e-4"],
                f"{c['max_tensor_diff_vs_exact']:.1e} ({c['worst_tensor_vs_exact']})", c["as_close_to_exact_as_stock"]]

    text += table(["graph", "layers swapped", "forward max err", "manifest tensors equal", "loss diff vs stock",
                   "max tensor diff vs stock", "eval loss diff", "within 1e-4 of stock", "max diff vs float64",
                   "as close to float64 as stock"], [[key, *cells(key)] for key in steps])
    names = list(profiles)
    if names:
        ops = list(dict.fromkeys(op for p in profiles.values() for op in p))
        totals = [sum(p.values()) for p in profiles.values()]
        ops.sort(key=lambda op: -max(p.get(op, 0.0) for p in profiles.values()))
        text += "\n\nORT kernel ms per training step by op (profile; shares in brackets):\n"
        groups = {"depthwise, all its ops": ("depthwise",), "ReLU + gradient, all ops": ("Relu", "Clip")}
        sums = [[sum(ms for op, ms in p.items() if any(k in op for k in keys)) for p in profiles.values()]
                for keys in groups.values()]
        text += table(["op", *names], [["total", *[f"{t:.0f}" for t in totals]]] + [
            [group, *[f"{v:.1f} ({v / t:.1%})" for v, t in zip(vals, totals, strict=True)]]
            for group, vals in zip(groups, sums, strict=True)] + [
            [op, *[f"{p.get(op, 0.0):.1f} ({p.get(op, 0.0) / t:.1%})" for p, t in zip(profiles.values(), totals,
                                                                                      strict=True)]]
            for op in ops[:14]])
    return text


if __name__ == "__main__":
    main(run, __doc__, quick="width 0.5, B=32, four graphs, one repeat")
