"""Partitions of a label array into per-device index arrays: the non-IID splits of FedPer, FedBABU
(shards) and Dirichlet(alpha), and the per-device train/test split.

Every function takes a `seed` and draws from one numpy Generator, so the same inputs and seed give
identical partitions on every machine. Returned index arrays are int64, sorted and disjoint."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fedper.data.errors import DataError

log = logging.getLogger("fedper.data")

# Dirichlet resampling gives up after this many draws rather than loop forever on an infeasible min_size.
DIRICHLET_TRIES = 1000


def _as_labels(labels: np.ndarray | Sequence[int], what: str = "labels") -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and not np.issubdtype(y.dtype, np.integer)):
        raise DataError(f"{what} must be a 1-D integer array, got {y.dtype} {y.shape}")
    return y.astype(np.int64, copy=False)


def _as_indices(idx: np.ndarray | Sequence[int], n: int, device: int) -> np.ndarray:
    arr = _as_labels(idx, f"indices of device {device}")
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise DataError(f"indices of device {device} span {arr.min()}..{arr.max()}, outside 0..{n - 1}")
    return arr


def _concat(chunks: list[np.ndarray]) -> np.ndarray:
    return np.sort(np.concatenate(chunks)) if chunks else np.empty(0, np.int64)


def _check_clients(n_clients: int, n_samples: int) -> None:
    if n_clients < 1:
        raise DataError(f"n_clients must be >= 1, got {n_clients}")
    if n_samples < n_clients:
        raise DataError(f"{n_samples} samples cannot be split among {n_clients} devices")


def _class_quotas(n_classes: int, slots: int, rng: np.random.Generator) -> np.ndarray:
    """How many devices may sample each class: the `slots` (devices x k) spread as evenly as they go,
    floor or ceil of slots/n_classes, the ceils (or, with fewer slots than classes, the single
    allowances) going to classes drawn at random."""
    quota = np.full(n_classes, slots // n_classes, np.int64)
    quota[rng.permutation(n_classes)[: slots % n_classes]] += 1
    return quota


def _allow_classes(n_classes: int, n_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each device's k distinct classes (positions into the class list), drawn at random per device
    such that class c is allowed to exactly quota[c] devices.

    Device by device, the classes still allowed to all m remaining devices are forced; the rest are
    drawn without replacement, weighted by the allowances each class has left, so that rarely
    drawn classes are not all left to the last devices. Forcing keeps every allowance <= m, which
    with m*k allowances left is all it takes for the remaining devices to be served, so the draw
    never dead-ends."""
    left = _class_quotas(n_classes, n_clients * k, rng)
    allowed = []
    for m in range(n_clients, 0, -1):
        forced = np.flatnonzero(left == m)
        free = np.flatnonzero((left > 0) & (left < m))
        weights = left[free] / left[free].sum() if len(free) else None
        drawn = rng.choice(free, size=k - len(forced), replace=False, p=weights)
        mine = np.sort(np.concatenate([forced, drawn]))
        left[mine] -= 1
        allowed.append(mine)
    return allowed


def split_k_classes(labels: np.ndarray | Sequence[int], n_clients: int, k: int, seed: int) -> list[np.ndarray]:
    """The FedPer paper's split: each device samples at most k classes, and a class's samples are
    divided equally (sizes differ by at most 1) among the devices allowed to sample it.

    Allowance: each device is allowed k classes drawn at random (see _allow_classes), every class to
    floor(n*k/C) or ceil(n*k/C) of the n devices, so every class is used when n*k >= C; with fewer
    slots than classes, C - n*k classes are unused, which is logged as a warning. A device gets
    fewer than k classes only when a class has fewer samples than devices allowed to sample it."""
    y = _as_labels(labels)
    classes = np.unique(y)
    _check_clients(n_clients, len(y))
    if not 1 <= k <= len(classes):
        raise DataError(f"k={k} classes per device, but the labels hold {len(classes)} classes")
    if n_clients * k < len(classes):
        log.warning(
            "%d of %d classes are used by no device: %d devices x k=%d classes allow only %d; "
            "use more devices or a larger k to use them all",
            len(classes) - n_clients * k, len(classes), n_clients, k, n_clients * k,
        )
    rng = np.random.default_rng(seed)
    owners: dict[int, list[int]] = {int(c): [] for c in classes}
    for dev, mine in enumerate(_allow_classes(len(classes), n_clients, k, rng)):
        for c in classes[mine]:
            owners[int(c)].append(dev)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c in classes:
        devices = owners[int(c)]
        if not devices:
            continue
        members = rng.permutation(np.flatnonzero(y == c))
        for dev, chunk in zip(rng.permutation(devices), np.array_split(members, len(devices)), strict=True):
            parts[dev].append(chunk)
    out = [_concat(p) for p in parts]
    empty = [i for i, p in enumerate(out) if len(p) == 0]
    if empty:
        raise DataError(
            f"{len(empty)} device(s) (e.g. {empty[:5]}) would get no samples: their classes have fewer "
            f"samples than devices sharing them; use fewer than {n_clients} devices or a larger k than {k}"
        )
    return out


def split_shards(
    labels: np.ndarray | Sequence[int], n_clients: int, shards_per_client: int, seed: int
) -> list[np.ndarray]:
    """FedBABU / McMahan et al.: sort by label, cut into n_clients*shards_per_client equal shards,
    deal each device shards_per_client of them at random. The remainder of N/(number of shards)
    samples (at the end of the label order) is unused; ties within a class are broken at random."""
    y = _as_labels(labels)
    if shards_per_client < 1:
        raise DataError(f"shards_per_client must be >= 1, got {shards_per_client}")
    _check_clients(n_clients, len(y))
    n_shards = n_clients * shards_per_client
    if n_shards > len(y):
        raise DataError(f"{n_shards} shards ({n_clients} devices x {shards_per_client}) but only {len(y)} samples")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    order = order[np.argsort(y[order], kind="stable")]
    size = len(y) // n_shards
    shards = order[: n_shards * size].reshape(n_shards, size)
    deal = rng.permutation(n_shards).reshape(n_clients, shards_per_client)
    return [np.sort(shards[d].ravel()) for d in deal]


def split_dirichlet(
    labels: np.ndarray | Sequence[int], n_clients: int, alpha: float, seed: int, min_size: int = 2
) -> list[np.ndarray]:
    """Per class, proportions over devices ~ Dir(alpha) (small alpha: few classes per device).
    Whole partitions are redrawn until every device has >= min_size samples, at most
    DIRICHLET_TRIES times. Every sample is used."""
    y = _as_labels(labels)
    _check_clients(n_clients, len(y))
    if not alpha > 0 or not np.isfinite(alpha):
        raise DataError(f"alpha must be a positive finite number, got {alpha}")
    if min_size < 0 or min_size * n_clients > len(y):
        raise DataError(f"min_size={min_size} for each of {n_clients} devices, but only {len(y)} samples")
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]
    for _ in range(DIRICHLET_TRIES):
        cuts = []
        sizes = np.zeros(n_clients, np.int64)
        for members in by_class:
            p = rng.dirichlet(np.full(n_clients, float(alpha)))
            bounds = (np.cumsum(p)[:-1] * len(members)).astype(np.int64)
            cuts.append(bounds)
            sizes += np.diff(bounds, prepend=0, append=len(members))
        if sizes.min() >= min_size:
            parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
            for members, bounds in zip(by_class, cuts, strict=True):
                for dev, chunk in enumerate(np.split(members, bounds)):
                    parts[dev].append(chunk)
            return [_concat(p) for p in parts]
    raise DataError(
        f"no Dirichlet(alpha={alpha}) draw in {DIRICHLET_TRIES} gave every one of {n_clients} devices "
        f">= {min_size} of {len(y)} samples; use fewer devices or a larger alpha"
    )


def _test_counts(counts: np.ndarray, test_fraction: float) -> np.ndarray:
    """Test samples per class, stratified first: each class gets floor or ceil of its quota
    count*test_fraction, but >= 1 on each side when it has >= 2 samples (a lone sample trains).
    Within those bounds the total is round(n*test_fraction), the ceils going to the largest
    remainders; where the bounds forbid that total, the per-class bounds win."""
    quota = np.round(counts * test_fraction, 9)  # so that e.g. 10*0.7 is 7, not 7.000000000000001
    lo = np.maximum(np.floor(quota), counts >= 2).astype(np.int64)
    hi = np.minimum(np.ceil(quota), np.maximum(counts - 1, 0)).astype(np.int64)
    target = int(np.floor(quota.sum() + 0.5))
    can_grow = np.flatnonzero(hi > lo)
    grow = can_grow[np.argsort(lo[can_grow] - quota[can_grow], kind="stable")]
    n_test = lo.copy()
    n_test[grow[: max(0, target - int(lo.sum()))]] += 1
    return n_test


def split_train_test(
    indices_per_client: Sequence[np.ndarray],
    labels: np.ndarray | Sequence[int],
    test_fraction: float = 0.2,
    seed: int = 0,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each device's samples -> (train, test), stratified per class, so that train and test hold the
    same classes wherever a class has >= 2 samples on the device (a lone sample goes to train)."""
    y = _as_labels(labels)
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    rng = np.random.default_rng(seed)
    out = []
    for dev, raw in enumerate(indices_per_client):
        idx = _as_indices(raw, len(y), dev)
        dev_labels = y[idx]
        classes, counts = np.unique(dev_labels, return_counts=True)
        train, test = [], []
        for c, n_test in zip(classes, _test_counts(counts, test_fraction), strict=True):
            members = rng.permutation(idx[dev_labels == c])
            test.append(members[:n_test])
            train.append(members[n_test:])
        out.append((_concat(train), _concat(test)))
    return out


def assign_test_by_classes(
    train_parts: Sequence[np.ndarray],
    train_labels: np.ndarray | Sequence[int],
    test_labels: np.ndarray | Sequence[int],
    seed: int,
) -> list[np.ndarray]:
    """For a source with its own test split: each device gets test samples of exactly the classes in
    its train part, a class's test samples divided equally (sizes differ by at most 1) among the
    devices holding it. Test classes no device holds are unused."""
    y_train, y_test = _as_labels(train_labels, "train_labels"), _as_labels(test_labels, "test_labels")
    holders: dict[int, list[int]] = {}
    for dev, raw in enumerate(train_parts):
        for c in np.unique(y_train[_as_indices(raw, len(y_train), dev)]):
            holders.setdefault(int(c), []).append(dev)
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in train_parts]
    for c in sorted(holders):
        devices = holders[c]
        members = rng.permutation(np.flatnonzero(y_test == c))
        if len(members) < len(devices):
            raise DataError(
                f"class {c} has {len(members)} test samples but {len(devices)} devices train on it, so some "
                f"would test without it; use fewer devices, fewer classes a device or more test samples"
            )
        for dev, chunk in zip(rng.permutation(devices), np.array_split(members, len(devices)), strict=True):
            parts[dev].append(chunk)
    return [_concat(p) for p in parts]


def chance_accuracy(test_labels: Sequence[np.ndarray | Sequence[int]], n_classes: int, personal: bool) -> float:
    """The mean accuracy over clients of a guess from the label prior alone, the line a curve must rise above
    to have learned anything from the images. A personal model (a head of its own) can always answer its
    client's most frequent test class; one model for every client (FedAvg), the one class whose mean share
    over the clients is largest. Clients without test samples are left out."""
    shares = np.array([np.bincount(y, minlength=n_classes) / len(y)
                       for y in (_as_labels(t, "test labels") for t in test_labels) if len(y)])
    if not len(shares):
        raise DataError("no client has test samples")
    return float(shares.max(axis=1).mean() if personal else shares.mean(axis=0).max())


def chance_words(test_labels: np.ndarray | Sequence[int]) -> str:
    """A device's chance line in words, for whoever reads its accuracy: its classes, and the accuracy of always
    answering its most frequent test class (chance_accuracy's personal rule; 1/k when the classes are balanced)."""
    y = _as_labels(test_labels, "test labels")
    if not len(y):
        return "no test images: no chance line"
    counts = np.bincount(y)
    k = int((counts > 0).sum())
    return f"{k} class{'es' if k != 1 else ''}: guessing the most frequent gives {100 * counts.max() / len(y):.0f} %"
