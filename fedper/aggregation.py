"""Aggregation rules, one implementation each, used by the emulator and the coordinator alike.

A rule is a small object with `add(tensors, n_samples)` and `result()`. The FedPer rule (paper,
Algorithm 2) is a running n_j-weighted sum, so memory is O(model) whatever the fleet size.
Tensors may be numpy arrays (the coordinator) or torch tensors on any device (the emulator's GPU
path runs the very same rule).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import Any

import numpy as np

Tensor = Any  # numpy.ndarray or torch.Tensor

# float64 elements of the numpy fold's scratch (1 MiB, a core's L2 cache on common x86): the flat sum
# is folded in blocks of this many elements (much smaller blocks cost more in calls than they save)
_FOLD_BLOCK = 1 << 17

Span = tuple[int, int, tuple[tuple[str, int, int], ...]]  # [start, stop) of the flat sum: (tensor, [lo, hi)) parts


def _fold_numpy(acc: np.ndarray, value: np.ndarray, weight: float, scratch: np.ndarray, fused: bool) -> None:
    """acc += weight * value through `scratch`: a full-size float64 temporary per tensor would double
    the peak memory. Cast by np.copyto (float32 -> float64, exact), then scaled and added by `_scale_add`,
    a scratch-sized block at a time (`acc` is contiguous: a view of the flat sum, or its own array)."""
    flat_acc, flat = acc.reshape(-1), value.reshape(-1)  # value.reshape copies only a non-contiguous value
    for start in range(0, flat.size, scratch.size):
        block = flat[start : start + scratch.size]
        weighted = scratch[: block.size]
        np.copyto(weighted, block)
        _scale_add(flat_acc[start : start + block.size], weighted, weight, fused)


@functools.cache
def _daxpy() -> Callable[..., Any] | None:
    """BLAS daxpy (acc += w * x in one pass), None without scipy and threadpoolctl (the fold then takes numpy's
    two passes, same bits). Imported by the first fold, not at start-up: scipy.linalg is a third of a
    coordinator's import time, paid again at every restart. It sets the process's BLAS libraries to one thread,
    once and for good: a multi-threaded daxpy on a loaded 2-core machine took 40-60x longer, and setting and
    restoring the thread count around every fold cost a tenth of the fold. The coordinator uses BLAS for little
    else (a norm in secure rounds, the int8-delta-rot decode)."""
    try:
        from scipy.linalg.blas import daxpy
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover
        return None
    ThreadpoolController().select(user_api="blas").limit(limits=1)  # not a context: the limit stays
    return daxpy


def _scale_add(acc: np.ndarray, weighted: np.ndarray, weight: float, fused: bool) -> None:
    """acc += weight * weighted for contiguous 1-D float64 views (`weighted` is overwritten). `fused`
    (see `_exact_products`): one BLAS pass, a fused multiply-add whose single rounding equals
    numpy's two when the product is exact; otherwise numpy's in-place multiply, then add."""
    if fused and acc.size:
        _daxpy()(weighted, acc, a=weight)  # in place: acc is contiguous float64
        return
    np.multiply(weighted, weight, out=weighted)
    np.add(acc, weighted, out=acc)


def _significant_bits(dtype: np.dtype) -> int:
    """The most significand bits a value of `dtype` has once cast to float64 (53: not known to be fewer)."""
    if dtype.kind == "f":
        return np.finfo(dtype).nmant + 1 if dtype.itemsize < 8 else 53
    return 8 * dtype.itemsize if dtype.kind in "biu" and dtype.itemsize <= 4 else 53


def _exact_products(weight: float, dtypes: Iterable[np.dtype]) -> bool:
    """Whether weight * float64(v) is exact for every v of these dtypes (the significands' bits fit
    float64's 53, and the weight is far from float64's range ends): a sample count (an integer below
    2^29) times float32 always is. Only then may the fold fuse multiply and add and keep the bits."""
    if _daxpy() is None or not 2.0**-800 < weight < 2.0**800:
        return False
    mantissa = int(math.frexp(weight)[0] * 2**53)
    weight_bits = 53 - ((mantissa & -mantissa).bit_length() - 1)
    return all(weight_bits + _significant_bits(dtype) <= 53 for dtype in dtypes)


def _spans(sizes: Mapping[str, int], block: int) -> list[Span]:
    """The flat sum (the tensors laid end to end, in order) cut into blocks of `block` elements, each
    with the slices of the tensors it holds: a block may hold many small tensors or part of a large one."""
    offsets = np.cumsum([0, *sizes.values()]).tolist()
    spans = []
    for start in range(0, offsets[-1], block):
        stop = min(start + block, offsets[-1])
        parts = tuple((name, max(start, begin) - begin, min(stop, end) - begin)
                      for name, begin, end in zip(sizes, offsets, offsets[1:], strict=False)
                      if max(start, begin) < min(stop, end))
        spans.append((start, stop, parts))
    return spans


def _fold_spans(flat: np.ndarray, spans: list[Span], tensors: Mapping[str, np.ndarray], weight: float,
                scratch: np.ndarray, fused: bool) -> None:
    """flat += weight * tensors, a block at a time: its parts cast into `scratch` by one concatenation,
    then scaled and added (two or three calls a block, not per tensor: a model has many small tensors)."""
    split: dict[str, np.ndarray] = {}  # a tensor over several blocks, flattened once (a copy if non-contiguous)

    def piece(name: str, lo: int, hi: int) -> np.ndarray:
        value = tensors[name]
        if hi - lo == value.size:
            return value  # whole: np.concatenate(axis=None) flattens it
        if name not in split:
            split[name] = value.reshape(-1)
        return split[name][lo:hi]

    for start, stop, parts in spans:
        weighted = scratch[: stop - start]
        np.concatenate([piece(*part) for part in parts], axis=None, out=weighted)  # float64, exact
        _scale_add(flat[start:stop], weighted, weight, fused)


class PackedTensors(Mapping[str, np.ndarray]):
    """A read-only mapping of numpy tensors that lie back to back in one 1-D array, `flat`, in the order
    of their sorted names: a safetensors data section whose tensors share one dtype (fedper.payload
    decodes an fp32 blob into one, without a copy). Checked here, by address, `flat` contiguous, so
    that WeightedMean may fold `flat` in a few large blocks instead of the tensors one by one."""

    def __init__(self, arrays: Mapping[str, np.ndarray], flat: np.ndarray) -> None:
        position = flat.__array_interface__["data"][0]
        for name in sorted(arrays):
            value = arrays[name]
            if (value.dtype != flat.dtype or not value.flags.c_contiguous
                    or value.__array_interface__["data"][0] != position):
                raise ValueError(f"{name} is not the next run of the flat array")
            position += value.nbytes
        if (flat.ndim != 1 or not flat.flags.c_contiguous
                or position != flat.__array_interface__["data"][0] + flat.nbytes):
            raise ValueError("the tensors do not cover the flat array")
        self._arrays = dict(arrays)
        self.flat = flat

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def keys(self) -> KeysView[str]:  # the dict's own views: Mapping's generic ones look up every name
        return self._arrays.keys()

    def values(self) -> ValuesView[np.ndarray]:
        return self._arrays.values()

    def items(self) -> ItemsView[str, np.ndarray]:
        return self._arrays.items()


def sample_weight(n_samples: float, total_weight: float) -> float:
    """n_samples as a positive finite float weight that keeps the running total finite; ValueError otherwise
    (an integer like 10**400 has no float: checked here, before a rule changes anything)."""
    try:
        weight = float(n_samples)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"a sample count must be a number of float range, got a {type(n_samples).__name__}") from None
    if not (math.isfinite(weight) and weight > 0 and math.isfinite(total_weight + weight)):
        raise ValueError(f"an update needs a positive sample count that keeps the total finite, got {weight}")
    return weight


def check_layout(tensors: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]] | None) -> None:
    """Every value an array of numbers and, when a layout is set, exactly its names and shapes; ValueError otherwise."""
    for name, value in tensors.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            continue
        if isinstance(value, np.ndarray) or not hasattr(value, "shape"):
            dtype = getattr(value, "dtype", None)
            raise ValueError(f"update tensor {name!r} must be a numeric array, got {type(value).__name__} {dtype}")
    if shapes is None:
        return
    if tensors.keys() != shapes.keys():
        missing, extra = set(shapes) - set(tensors), set(tensors) - set(shapes)
        raise ValueError(f"update layout differs: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
    for name, value in tensors.items():  # a shape may be a tuple, a list or a torch.Size: compare as tuples
        if value.shape != shapes[name] and tuple(value.shape) != tuple(shapes[name]):
            raise ValueError(f"update layout differs: {name} has shape {tuple(value.shape)}, not {tuple(shapes[name])}")


def _scaled(acc: Tensor, scale: float, dtype: Any) -> Tensor:
    """acc * scale cast to dtype; numpy writes straight into the result (no float64 temporary)."""
    if isinstance(acc, np.ndarray):
        return np.multiply(acc, scale, out=np.empty(acc.shape, dtype), casting="unsafe")
    return (acc * scale).to(dtype)


class WeightedMean:
    """W = sum_j gamma_j W_j with gamma_j = n_j / sum n_j over the updates that were added.

    The sum is float64 so that the result does not depend on the order updates arrive in (to 1e-12).
    For numpy updates it is one flat array (each tensor's sum a view of it), into which an update is
    folded a block of the flat sum at a time through a bounded scratch (peak: the sum + the update being added);
    a PackedTensors update is one array already, folded as such.
    Its state is (sums, total_weight, count): `sums()` and `from_sums` checkpoint and resume it bit
    for bit (the coordinator's restart)."""

    def __init__(self) -> None:
        self._sum: dict[str, Tensor] = {}
        self._flat: np.ndarray | None = None  # numpy updates: every sum in one array, self._sum holds views
        self._spans: list[Span] = []
        self._shapes: dict[str, tuple[int, ...]] = {}  # the flat sum's layout, for check_layout
        self._dtype: dict[str, Any] = {}  # only the dtype: keeping the first update would cost a model's memory
        self._scratch = np.empty(_FOLD_BLOCK, np.float64)
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, Tensor], n_samples: float) -> None:
        """Fold one update in, all or nothing: every check (the weight, the layout) runs before the sum
        changes, so a refused update (ValueError) leaves the rule as it was."""
        weight = sample_weight(n_samples, self.total_weight)
        check_layout(tensors, self._shapes if self._flat is not None
                     else {name: acc.shape for name, acc in self._sum.items()} if self._sum else None)
        if not self._sum and all(isinstance(value, np.ndarray) for value in tensors.values()):
            self._lay_out({name: value.shape for name, value in tensors.items()})
        if len(self._dtype) < len(tensors):  # the first update's dtypes (the layout holds the names after it)
            for name, value in tensors.items():
                self._dtype.setdefault(name, value.dtype)
        fused = _exact_products(weight, {value.dtype for value in tensors.values() if isinstance(value, np.ndarray)})
        if self._flat is not None:
            if isinstance(tensors, PackedTensors):  # checked: same names and shapes, so the same flat layout
                _fold_numpy(self._flat, tensors.flat, weight, self._scratch, fused)
            else:
                _fold_spans(self._flat, self._spans, tensors, weight, self._scratch, fused)
            self.total_weight += weight
            self.count += 1
            return
        for name, value in tensors.items():  # torch tensors (or a mix): tensor by tensor
            if isinstance(value, np.ndarray):
                if name not in self._sum:
                    self._sum[name] = np.zeros(value.shape, np.float64)
                _fold_numpy(self._sum[name], value, weight, self._scratch, fused)
            elif name in self._sum:  # torch
                self._sum[name] += value.double() * weight
            else:
                self._sum[name] = value.double() * weight
        self.total_weight += weight
        self.count += 1

    @classmethod
    def from_sums(cls, sums: Mapping[str, np.ndarray], total_weight: float, count: int,
                  dtypes: Mapping[str, Any]) -> WeightedMean:
        """The rule as `sums()` left it: Σ n_j W_j (float64) over `count` updates weighing `total_weight`;
        `dtypes` are the updates' (what `result` casts back to)."""
        if count < 1 or total_weight <= 0:
            raise ValueError(f"a resumed sum needs updates: count {count}, total weight {total_weight}")
        if set(sums) != set(dtypes) or any(np.asarray(v).dtype != np.float64 for v in sums.values()):
            raise ValueError("resumed sums must be float64 and name exactly the tensors of `dtypes`")
        rule = cls()
        rule._lay_out({name: np.shape(value) for name, value in sums.items()})
        for name, value in sums.items():
            np.copyto(rule._sum[name], value)
        rule._dtype = {name: np.dtype(dtype) for name, dtype in dtypes.items()}
        rule.total_weight, rule.count = float(total_weight), count
        return rule

    def _lay_out(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """A zero flat float64 sum with a view per tensor, laid out in sorted-name order (a
        PackedTensors' order), and its fold blocks; `_sum` keeps the order of `shapes`."""
        sizes = {name: math.prod(shapes[name]) for name in sorted(shapes)}
        self._flat = np.zeros(sum(sizes.values()), np.float64)
        offsets = dict(zip(sizes, np.cumsum([0, *sizes.values()]).tolist(), strict=False))
        self._sum = {name: self._flat[offsets[name] : offsets[name] + sizes[name]].reshape(shape)
                     for name, shape in shapes.items()}
        self._spans = _spans(sizes, _FOLD_BLOCK)
        self._shapes = {name: tuple(shape) for name, shape in shapes.items()}

    def sums(self) -> dict[str, Tensor]:
        """Σ n_j W_j per tensor, float64: the rule's own arrays, not copies (a checkpoint written from
        them needs no full-size temporary). Do not modify them."""
        return dict(self._sum)

    def result(self, dtype: Any = None) -> dict[str, Tensor]:
        """The mean in each tensor's dtype, or in numpy `dtype`."""
        if not self.count:
            raise ValueError("no update to aggregate")
        scale = 1.0 / self.total_weight
        return {name: _scaled(acc, scale, dtype or self._dtype[name]) for name, acc in self._sum.items()}


def weighted_mean(updates: list[tuple[Mapping[str, Tensor], float]]) -> dict[str, Tensor]:
    """Convenience for a list of (tensors, n_samples)."""
    rule = WeightedMean()
    for tensors, n in updates:
        rule.add(tensors, n)
    return rule.result()


# ---------------------------------------------------------------- robust rules and clipping
# These need every update of a round at once: memory is O(devices x model) (kept in RAM, nothing
# spilled to disk). They ignore n_samples on purpose: a robust rule must not let one device's
# claimed sample count outweigh the others. They work on numpy arrays only (the coordinator's path).


def _stack(updates: list[Mapping[str, Any]], name: str) -> Any:
    return np.stack([np.asarray(u[name], dtype=np.float64) for u in updates])


class _Collect:
    """Keeps the round's updates; subclasses reduce them coordinate-wise."""

    def __init__(self) -> None:
        self._updates: list[Mapping[str, Any]] = []
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, Any], n_samples: float) -> None:
        """Keep one update, all or nothing: a refused one (ValueError) leaves the rule as it was."""
        weight = sample_weight(n_samples, self.total_weight)
        first = self._updates[0] if self._updates else None
        check_layout(tensors, {name: value.shape for name, value in first.items()} if first else None)
        self._updates.append(dict(tensors))
        self.total_weight += weight
        self.count += 1

    def updates(self) -> list[Mapping[str, Any]]:
        """The kept updates in the order they came (a checkpoint writes them; adding them again rebuilds the rule)."""
        return list(self._updates)

    def result(self) -> dict[str, Any]:
        if not self.count:
            raise ValueError("no update to aggregate")
        first = self._updates[0]
        return {name: self._reduce(_stack(self._updates, name)).astype(first[name].dtype) for name in first}

    def _reduce(self, stacked: Any) -> Any:
        raise NotImplementedError


class CoordinateMedian(_Collect):
    """Coordinate-wise median (Yin et al. 2018): robust to a minority of arbitrary updates."""

    def _reduce(self, stacked: Any) -> Any:
        return np.median(stacked, axis=0)


class TrimmedMean(_Collect):
    """Coordinate-wise mean after dropping the `trim` fraction of largest and of smallest values."""

    def __init__(self, trim: float = 0.2) -> None:
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        super().__init__()
        self.trim = trim

    def _reduce(self, stacked: Any) -> Any:
        k = int(self.trim * len(stacked))
        ordered = np.sort(stacked, axis=0)
        return ordered[k : len(stacked) - k].mean(axis=0)


RULES: dict[str, type[WeightedMean] | type[_Collect]] = {  # by name, as --aggregator names them
    "mean": WeightedMean,
    "median": CoordinateMedian,
    "trimmed-mean": TrimmedMean,
}


def as_float64(value: Tensor) -> Tensor:
    """A numpy array or a torch tensor in float64 (a copy)."""
    return value.astype(np.float64) if isinstance(value, np.ndarray) else value.double()


def _squared_norm(value: Tensor) -> float:
    return float((value * value).sum())


def delta_norm(tensors: Mapping[str, Tensor], reference: Mapping[str, Tensor], names: Iterable[str]) -> float:
    """L2 norm of (tensors - reference) over `names`, computed in float64 one tensor at a time."""
    return math.sqrt(sum(_squared_norm(as_float64(tensors[n]) - as_float64(reference[n])) for n in names))


def clip_factor(norm: float, clip_norm: float) -> float:
    """The scale that brings a delta of L2 norm `norm` to at most `clip_norm` (1 when it is already within)."""
    return 1.0 if norm <= clip_norm else clip_norm / norm


def clip_update(tensors: Mapping[str, Any], reference: Mapping[str, Any], max_norm: float) -> dict[str, Any]:
    """Scale the update (tensors - reference) down to an L2 norm of at most max_norm (over all tensors)."""
    scale = clip_factor(delta_norm(tensors, reference, tensors), max_norm)
    clipped = {}
    for name, value in tensors.items():
        base = as_float64(reference[name])
        clipped[name] = (base + (as_float64(value) - base) * scale).astype(value.dtype)
    return clipped
