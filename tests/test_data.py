"""fedper.data: partition invariants as properties, and every loader on data the tests write
(plus real CIFAR-10 images from ../shared/data when present)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fedper.data import (
    ArrayDataset,
    DataError,
    assign_test_by_classes,
    load_cifar,
    load_digits,
    load_flickr_aes,
    load_image_folder,
    load_npz,
    split_dirichlet,
    split_k_classes,
    split_shards,
    split_train_test,
    to_float_nchw,
)
from fedper.data.sources import FLICKR_CSV, FLICKR_IMAGES

REPO_ROOT = Path(__file__).resolve().parents[1]
CIFAR_JPEG = REPO_ROOT.parent / "shared" / "data" / "cifar10-jpeg.npz"
PROPERTY = settings(max_examples=50, deadline=None, database=None)
SEEDS = st.integers(0, 2**32 - 1)


def assert_disjoint(parts: list[np.ndarray], n: int) -> np.ndarray:
    """Every part sorted int64 indices in range, no sample in two parts (or twice in one)."""
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)
    used = np.concatenate(parts)
    assert len(np.unique(used)) == len(used)
    assert used.size == 0 or (used.min() >= 0 and used.max() < n)
    return used


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@st.composite
def labels_with_counts(draw: st.DrawFn, min_count: int, max_classes: int = 8) -> np.ndarray:
    """Shuffled labels with non-contiguous class ids, each class holding >= min_count samples."""
    n_classes = draw(st.integers(1, max_classes))
    ids = draw(st.permutations(range(3 * max_classes)))[:n_classes]
    counts = draw(st.lists(st.integers(min_count, min_count + 25), min_size=n_classes, max_size=n_classes))
    return np.random.default_rng(draw(SEEDS)).permutation(np.repeat(ids, counts))


# ---- split_k_classes ----


@PROPERTY
@given(data=st.data(), n_clients=st.integers(1, 12), seed=SEEDS)
def test_k_classes_invariants(data: st.DataObject, n_clients: int, seed: int) -> None:
    labels = data.draw(labels_with_counts(min_count=n_clients))
    classes = np.unique(labels)
    k = data.draw(st.integers(1, len(classes)))
    parts = split_k_classes(labels, n_clients, k, seed)
    assert len(parts) == n_clients
    assert_disjoint(parts, len(labels))
    per_class: dict[int, list[int]] = {int(c): [] for c in classes}
    for p in parts:
        held, counts = np.unique(labels[p], return_counts=True)
        # <= k always; exactly k here, since no class has fewer samples than devices
        assert len(held) == k
        for c, m in zip(held, counts, strict=True):
            per_class[int(c)].append(int(m))
    allowance = n_clients * k / len(classes)
    for c, sizes in per_class.items():
        assert len(sizes) in (math.floor(allowance), math.ceil(allowance))  # classes allowed evenly
        if sizes:
            assert max(sizes) - min(sizes) <= 1  # divided equally among the devices allowed it
            assert sum(sizes) == np.count_nonzero(labels == c)  # and wholly used
    assert_same(parts, split_k_classes(labels, n_clients, k, seed))


def test_k_classes_paper_setting_on_cifar_sized_labels() -> None:
    labels = np.repeat(np.arange(10), 500)
    parts = split_k_classes(labels, n_clients=20, k=4, seed=3)
    # 20 devices x 4 classes = 80 allowances, 8 per class: 500/8 -> 62 or 63 samples
    for p in parts:
        assert set(np.unique(np.bincount(labels[p], minlength=10))) <= {0, 62, 63}
    assert sum(len(p) for p in parts) == 5000


@pytest.mark.parametrize("k", [4, 5, 8])
def test_k_classes_draws_class_sets_per_device(k: int) -> None:
    # N = 10 devices on 10 classes: a cyclic allowance from one permutation repeats every
    # lcm(k, 10)/k devices (5 distinct sets for k = 4 or 8, 2 for k = 5); drawn per device, nearly all differ
    labels = np.repeat(np.arange(10), 50)
    for seed in range(10):
        parts = split_k_classes(labels, n_clients=10, k=k, seed=seed)
        class_sets = [frozenset(np.unique(labels[p]).tolist()) for p in parts]
        assert all(len(s) == k for s in class_sets)
        assert len(set(class_sets)) >= 8, (seed, class_sets)
        assert set().union(*class_sets) == set(range(10))  # every class owned


def test_k_classes_warns_of_unused_classes(caplog: pytest.LogCaptureFixture) -> None:
    labels = np.repeat(np.arange(100), 5)  # CIFAR-100's classes, N = 10, k = 4: 40 slots for 100 classes
    with caplog.at_level("WARNING", logger="fedper.data"):
        parts = split_k_classes(labels, n_clients=10, k=4, seed=0)
    assert [r.getMessage().split(" classes")[0] for r in caplog.records] == ["60 of 100"]
    used = np.concatenate([labels[p] for p in parts])
    assert len(np.unique(used)) == 40 and len(used) == 40 * 5  # each used class wholly, on one device
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedper.data"):
        split_k_classes(labels, n_clients=25, k=4, seed=0)
    assert not caplog.records


@pytest.mark.parametrize(
    ("labels", "n_clients", "k", "message"),
    [
        (np.repeat(np.arange(10), 5), 5, 11, "k=11"),
        (np.repeat(np.arange(10), 5), 5, 0, "k=0"),
        (np.arange(3), 4, 1, "3 samples cannot be split among 4"),
        (np.arange(3), 0, 1, "n_clients"),
        # 2 classes, k=1, 4 devices: each class is shared by 2 devices, and class 1 has 1 sample
        (np.array([0, 0, 0, 0, 0, 1]), 4, 1, "would get no samples"),
    ],
)
def test_k_classes_errors(labels: np.ndarray, n_clients: int, k: int, message: str) -> None:
    with pytest.raises(DataError, match=message):
        split_k_classes(labels, n_clients, k, seed=0)


# ---- split_shards ----


@PROPERTY
@given(
    n_clients=st.integers(1, 10),
    shards=st.integers(1, 4),
    extra=st.integers(0, 150),
    n_classes=st.integers(1, 10),
    seed=SEEDS,
)
def test_shards_invariants(n_clients: int, shards: int, extra: int, n_classes: int, seed: int) -> None:
    n = n_clients * shards + extra
    labels = np.random.default_rng(seed).integers(0, n_classes, n)
    parts = split_shards(labels, n_clients, shards, seed)
    assert len(parts) == n_clients
    assert_disjoint(parts, n)
    assert {len(p) for p in parts} == {shards * (n // (n_clients * shards))}
    assert_same(parts, split_shards(labels, n_clients, shards, seed))


def test_shards_are_label_sorted() -> None:
    """McMahan's pathological split: 100 per class in shards of 10 -> each device <= 2 classes."""
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 100))
    parts = split_shards(labels, n_clients=50, shards_per_client=2, seed=0)
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)
    assert any(len(np.unique(labels[p])) == 2 for p in parts)


def test_shards_errors() -> None:
    with pytest.raises(DataError, match="12 shards"):
        split_shards(np.zeros(10, int), 4, 3, seed=0)
    with pytest.raises(DataError, match="shards_per_client"):
        split_shards(np.zeros(10, int), 4, 0, seed=0)


# ---- split_dirichlet ----


@PROPERTY
@given(
    data=st.data(),
    n_clients=st.integers(1, 8),
    alpha=st.floats(0.5, 10.0),
    min_size=st.integers(0, 3),
    seed=SEEDS,
)
def test_dirichlet_invariants(data: st.DataObject, n_clients: int, alpha: float, min_size: int, seed: int) -> None:
    labels = data.draw(labels_with_counts(min_count=5 * n_clients, max_classes=6))
    parts = split_dirichlet(labels, n_clients, alpha, seed, min_size=min_size)
    assert len(parts) == n_clients
    used = assert_disjoint(parts, len(labels))
    assert len(used) == len(labels)  # every sample is used
    assert min(len(p) for p in parts) >= min_size
    assert_same(parts, split_dirichlet(labels, n_clients, alpha, seed, min_size=min_size))


def test_dirichlet_alpha_controls_skew() -> None:
    labels = np.repeat(np.arange(10), 200)

    def dominant_share(alpha: float) -> float:
        parts = split_dirichlet(labels, 10, alpha, seed=0, min_size=1)
        return float(np.mean([np.bincount(labels[p]).max() / len(p) for p in parts]))

    assert dominant_share(0.05) > 0.5
    assert dominant_share(100.0) < 0.25


def test_dirichlet_errors() -> None:
    with pytest.raises(DataError, match="alpha"):
        split_dirichlet(np.zeros(50, int), 5, 0.0, seed=0)
    with pytest.raises(DataError, match="min_size=2"):
        split_dirichlet(np.zeros(9, int), 5, 1.0, seed=0, min_size=2)
    with pytest.raises(DataError, match="no Dirichlet"):  # 2 each out of 20 at alpha=0.01: never drawn
        split_dirichlet(np.zeros(20, int), 10, 0.01, seed=0, min_size=2)


# ---- split_train_test / assign_test_by_classes ----


@PROPERTY
@given(
    n=st.integers(0, 200),
    n_classes=st.integers(1, 6),
    n_clients=st.integers(1, 6),
    fraction=st.floats(0.05, 0.95),
    seed=SEEDS,
)
def test_train_test_invariants(n: int, n_classes: int, n_clients: int, fraction: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_classes, n)
    parts = np.array_split(rng.permutation(n), n_clients)
    splits = split_train_test(parts, labels, fraction, seed)
    assert len(splits) == n_clients
    for part, (train, test) in zip(parts, splits, strict=True):
        assert_disjoint([train, test], n)
        assert sorted(np.concatenate([train, test]).tolist()) == sorted(part.tolist())
        classes, counts = np.unique(labels[part], return_counts=True)
        quota = counts * fraction
        lo = np.maximum(np.floor(quota + 1e-9), counts >= 2)
        hi = np.minimum(np.ceil(quota - 1e-9), counts - 1)
        n_test = np.array([np.count_nonzero(labels[test] == c) for c in classes], dtype=int)
        assert np.all((lo <= n_test) & (n_test <= hi))  # stratified, >= 1 each side when possible
        assert set(labels[train]) == set(classes)
        assert set(labels[test]) == set(classes[counts >= 2])
        target = math.floor(len(part) * fraction + 0.5)
        assert len(test) == min(max(target, lo.sum()), hi.sum())  # the 80/20 total where allowed
    assert_same(
        [a for pair in splits for a in pair],
        [a for pair in split_train_test(parts, labels, fraction, seed) for a in pair],
    )


@PROPERTY
@given(data=st.data(), n_clients=st.integers(1, 8), seed=SEEDS)
def test_assign_test_by_classes_invariants(data: st.DataObject, n_clients: int, seed: int) -> None:
    train_labels = data.draw(labels_with_counts(min_count=n_clients))
    classes = np.unique(train_labels)
    k = data.draw(st.integers(1, len(classes)))
    test_counts = data.draw(st.lists(st.integers(n_clients, n_clients + 10), min_size=3 * 8, max_size=3 * 8))
    test_labels = np.repeat(np.arange(3 * 8), test_counts)  # includes classes absent from train
    train_parts = split_k_classes(train_labels, n_clients, k, seed)
    test_parts = assign_test_by_classes(train_parts, train_labels, test_labels, seed)
    assert_disjoint(test_parts, len(test_labels))
    sizes: dict[int, list[int]] = {}
    for tr, te in zip(train_parts, test_parts, strict=True):
        assert set(test_labels[te]) == set(train_labels[tr])
        for c in set(train_labels[tr]):
            sizes.setdefault(int(c), []).append(int(np.count_nonzero(test_labels[te] == c)))
    for c, s in sizes.items():
        assert max(s) - min(s) <= 1
        assert sum(s) == test_counts[c]
    assert_same(test_parts, assign_test_by_classes(train_parts, train_labels, test_labels, seed))


def test_assign_test_too_few_test_samples() -> None:
    with pytest.raises(DataError, match="class 1 has 1 test samples but 2 devices"):
        assign_test_by_classes([np.array([0, 1]), np.array([2, 3])], [1, 1, 1, 1], [1, 0, 0], seed=0)


def test_train_test_errors() -> None:
    with pytest.raises(DataError, match="test_fraction"):
        split_train_test([np.arange(5)], np.zeros(5, int), test_fraction=1.0)
    with pytest.raises(DataError, match="device 1"):
        split_train_test([np.arange(5), np.array([7])], np.zeros(5, int))


@pytest.mark.parametrize(
    "split",
    [
        lambda y, s: split_k_classes(y, 10, 3, s),
        lambda y, s: split_shards(y, 10, 2, s),
        lambda y, s: split_dirichlet(y, 10, 0.5, s),
        lambda y, s: [a for pair in split_train_test(np.array_split(np.arange(len(y)), 5), y, 0.2, s) for a in pair],
        lambda y, s: assign_test_by_classes(split_shards(y, 10, 2, 0), y, y, s),
    ],
    ids=["k_classes", "shards", "dirichlet", "train_test", "assign_test"],
)
def test_seed_changes_partition(split) -> None:
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 50))
    a, b = split(labels, 0), split(labels, 1)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ---- sources ----


def _png(path: Path, size: tuple[int, int], colour: tuple[int, int, int], mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour if mode == "RGB" else colour[0]).save(path)


COLOURS = {"ant": (10, 20, 30), "cat": (200, 0, 0), "dog": (0, 0, 250)}


def test_image_folder_train_test_layout(tmp_path: Path) -> None:
    for split, n in (("train", 3), ("test", 2)):
        for name in ("dog", "cat", "ant"):
            for i in range(n):
                _png(tmp_path / split / name / f"{i}.png", (6, 5), COLOURS[name])
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image, ignored")
    _png(tmp_path / "train" / "ant" / "gray.png", (6, 5), (77, 77, 77), mode="L")
    splits = load_image_folder(tmp_path)
    assert splits.train.classes == ["ant", "cat", "dog"] == splits.test.classes
    assert splits.train.x.shape == (10, 5, 6, 3) and splits.test.x.shape == (6, 5, 6, 3)
    assert splits.train.x.dtype == np.uint8 and splits.train.y.dtype == np.int64
    for ds in (splits.train, splits.test):
        for x, y in zip(ds.x, ds.y, strict=True):
            expected = COLOURS[ds.classes[y]]
            assert tuple(x[0, 0]) in (expected, (77, 77, 77))
    assert np.count_nonzero(np.all(splits.train.x[:, 0, 0] == 77, axis=-1)) == 1  # gray -> RGB


def test_image_folder_flat_layout_resizes(tmp_path: Path) -> None:
    _png(tmp_path / "b" / "x.png", (9, 7), (1, 2, 3))
    _png(tmp_path / "a" / "y.jpg", (4, 4), (50, 100, 150))
    splits = load_image_folder(tmp_path, image_size=8)
    assert splits.test is None
    assert splits.train.classes == ["a", "b"]
    assert splits.train.x.shape == (2, 8, 8, 3)
    np.testing.assert_array_equal(splits.train.y, [0, 1])
    assert np.all(splits.train.x[1] == (1, 2, 3))
    with pytest.raises(DataError, match=r"x\.png is 9x7 .* pass image_size"):
        load_image_folder(tmp_path)


@pytest.mark.parametrize("content", [b"definitely not an image", "truncated"])
def test_image_folder_corrupt_image_names_file(tmp_path: Path, content: bytes | str) -> None:
    _png(tmp_path / "a" / "ok.png", (32, 32), (1, 2, 3))
    if content == "truncated":
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "PNG")
        content = buf.getvalue()[: len(buf.getvalue()) // 2]
    (tmp_path / "a" / "broken.png").write_bytes(content)
    with pytest.raises(DataError, match=r"broken\.png"):
        load_image_folder(tmp_path)


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere"):
        load_image_folder(tmp_path / "nowhere")
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        load_image_folder(tmp_path / "empty_root")
    _png(tmp_path / "r" / "a" / "1.png", (4, 4), (0, 0, 0))
    (tmp_path / "r" / "b").mkdir()
    with pytest.raises(DataError, match=r"class folder .*b holds no images"):
        load_image_folder(tmp_path / "r")
    _png(tmp_path / "s" / "train" / "a" / "1.png", (4, 4), (0, 0, 0))
    _png(tmp_path / "s" / "test" / "zebra" / "1.png", (4, 4), (0, 0, 0))
    with pytest.raises(DataError, match="zebra"):
        load_image_folder(tmp_path / "s")


def test_npz_round_trip_and_grayscale(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, (6, 4, 5, 3), dtype=np.uint8)
    x_test = rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)  # grayscale
    np.savez(
        tmp_path / "d.npz", x_train=x_train, y_train=np.array([0, 1, 2, 0, 1, 2], np.uint8),
        x_test=x_test, y_test=np.array([2, 1, 0]), classes=np.array(["a", "b", "c"]),
    )
    splits = load_npz(tmp_path / "d.npz")
    np.testing.assert_array_equal(splits.train.x, x_train)
    assert splits.train.y.dtype == np.int64 and splits.train.classes == ["a", "b", "c"]
    assert splits.test.x.shape == (3, 4, 5, 3)
    for ch in range(3):
        np.testing.assert_array_equal(splits.test.x[..., ch], x_test)
    np.savez(tmp_path / "t.npz", x_train=x_train, y_train=np.array([0, 3, 0, 3, 0, 3]))
    only_train = load_npz(tmp_path / "t.npz")
    assert only_train.test is None and only_train.train.classes == ["0", "1", "2", "3"]


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x_train": np.zeros((2, 4, 4, 3), np.uint8)}, r"lacks key\(s\) \['y_train'\]"),
        ({"x_train": np.zeros((2, 4, 4, 3), np.uint8), "y_train": np.zeros(3, int)}, "2 images but y_train has 3"),
        ({"x_train": np.zeros((2, 3, 4, 4), np.uint8), "y_train": np.zeros(2, int)}, "channels first"),
        ({"x_train": np.zeros((2, 4, 4, 3)), "y_train": np.zeros(2, int)}, "must be uint8"),
        (
            {"x_train": np.zeros((2, 4, 4, 3), np.uint8), "y_train": np.array([0, 2]), "classes": np.array(["a", "b"])},
            "outside 0..1",
        ),
        (
            {"x_train": np.zeros((2, 4, 4, 3), np.uint8), "y_train": np.zeros(2, int), "x_test": np.zeros((1, 4, 4))},
            "x_test / y_test",
        ),
    ],
)
def test_npz_errors(tmp_path: Path, arrays: dict[str, np.ndarray], message: str) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=message):
        load_npz(tmp_path / "bad.npz")


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no such \.npz file"):
        load_npz(tmp_path / "absent.npz")


def test_digits() -> None:
    from sklearn.datasets import load_digits as sk_load_digits

    splits = load_digits()
    x, y = splits.train.x, splits.train.y
    assert splits.test is None
    assert x.shape == (1797, 32, 32, 3) and x.dtype == np.uint8
    assert splits.train.classes == [str(d) for d in range(10)]
    assert set(np.bincount(y)) <= set(range(170, 190)) and len(np.bincount(y)) == 10
    assert np.array_equal(x[..., 0], x[..., 2]) and x.max() == 255
    native = load_digits(image_size=8).train.x[..., 0]
    np.testing.assert_array_equal(native, np.rint(sk_load_digits().images * 255 / 16))


def test_to_float_nchw() -> None:
    x = np.random.default_rng(0).integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    out = to_float_nchw(x, mean, std)
    assert out.shape == (2, 3, 4, 5) and out.dtype == np.float32 and out.flags.c_contiguous
    expected = ((x / 255.0 - np.array(mean)) / np.array(std)).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(DataError, match="one per channel"):
        to_float_nchw(x, (0.5,), (0.2,))


def test_array_dataset_validates_and_subsets() -> None:
    ds = ArrayDataset(np.zeros((4, 2, 2, 3), np.uint8), np.array([0, 1, 1, 0], np.int32), ["a", "b"])
    assert ds.y.dtype == np.int64 and len(ds) == 4
    sub = ds.subset(np.array([1, 2]))
    assert len(sub) == 2 and sub.classes == ["a", "b"] and sub.y.tolist() == [1, 1]
    with pytest.raises(DataError, match="3 labels"):
        ArrayDataset(np.zeros((4, 2, 2, 3), np.uint8), np.zeros(3, int), ["a"])


def test_cifar_without_download_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"cifar100 not found under .*--data takes the folder that holds "
                                        r"cifar-100-python/") as error:
        load_cifar(tmp_path, "cifar100")
    assert "--download" not in str(error.value) and "download=" not in str(error.value)  # no such option
    # the folder torchvision looks for, but without its files: torchvision's own check, as a DataError
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(DataError, match=r"could not read cifar10 from .*cifar-10-batches-py"):
        load_cifar(tmp_path, "cifar10")


# ---- FLICKR-AES replica in the published layout ----

QUALIFYING = [60, 290, *np.random.default_rng(1).integers(60, 100, 29).tolist()]
OUTSIDE = [5, 59, 291, 300]


def _write_flickr(root: Path, counts: list[int], seed: int = 0) -> None:
    """CSV (padded header, rows interleaved) + one JPEG per rating under 40K/. The red channel
    encodes the score (40*score), the green one the worker's position in `counts` (7*i)."""
    rng = np.random.default_rng(seed)
    rows = []
    for w, count in enumerate(counts):
        for j in range(count):
            score = int(rng.integers(1, 6))
            name = f"farm{w % 9 + 1}_{w:03d}{j:04d}_{rng.integers(1e9):x}_b.jpg"
            Image.new("RGB", (12, 12), (40 * score, 7 * w, 90)).save(root / FLICKR_IMAGES / name, quality=95)
            rows.append((f"W{w:02d}", name, score))
    order = rng.permutation(len(rows))
    with (root / FLICKR_CSV).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([" worker", " imagePair", " score "])
        writer.writerows(rows[i] for i in order)


@pytest.fixture(scope="module")
def flickr_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("flickr")
    (root / FLICKR_IMAGES).mkdir()
    _write_flickr(root, QUALIFYING + OUTSIDE)
    return root


def _worker_of(ds: ArrayDataset) -> int:
    workers = np.unique(np.rint(ds.x[:, :, :, 1].astype(float) / 7))
    assert len(workers) == 1  # one worker's images only
    return int(workers[0])


def test_flickr_selects_workers_in_bounds(flickr_root: Path) -> None:
    devices = load_flickr_aes(flickr_root, n_workers=len(QUALIFYING), image_size=8, seed=0)
    counts = QUALIFYING + OUTSIDE
    workers = [_worker_of(d.train) for d in devices]
    assert sorted(workers) == list(range(len(QUALIFYING)))  # exactly those with 60..290 ratings
    for w, d in zip(workers, devices, strict=True):
        n = len(d.train) + len(d.test)
        assert n == counts[w]
        assert len(d.test) == math.floor(0.2 * n + 0.5)
        assert d.train.x.shape[1:] == (8, 8, 3) and d.train.classes == ["1", "2", "3", "4", "5"]
        assert set(d.train.y) == set(d.test.y)
        for ds in (d.train, d.test):
            scores = np.rint(ds.x[:, 4, 4, 0].astype(float) / 40)
            np.testing.assert_array_equal(ds.y, scores - 1)  # label = score - 1


def test_flickr_draw_is_seeded(flickr_root: Path) -> None:
    def drawn(seed: int) -> list[int]:
        return [_worker_of(d.train) for d in load_flickr_aes(flickr_root, n_workers=30, image_size=4, seed=seed)]

    first = drawn(0)
    assert len(set(first)) == 30 and set(first) < set(range(len(QUALIFYING)))
    assert drawn(0) == first
    assert drawn(1) != first or drawn(2) != first


def test_flickr_errors(flickr_root: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"only {len(QUALIFYING)} of {len(QUALIFYING) + len(OUTSIDE)} workers"):
        load_flickr_aes(flickr_root, n_workers=len(QUALIFYING) + 1, image_size=4)
    with pytest.raises(DataError, match=f"ratings file not found: .*{FLICKR_CSV}"):
        load_flickr_aes(tmp_path, image_size=4)
    (tmp_path / FLICKR_IMAGES).mkdir()
    _write_flickr(tmp_path, [60])
    victim = sorted((tmp_path / FLICKR_IMAGES).iterdir())[7]
    victim.unlink()
    with pytest.raises(DataError, match=f"image not found: .*{victim.name}"):
        load_flickr_aes(tmp_path, n_workers=1, image_size=4)
    with (tmp_path / FLICKR_CSV).open("a") as f:
        f.write("W00,x.jpg,7\n")
    with pytest.raises(DataError, match=r"line 62: score '7'"):
        load_flickr_aes(tmp_path, n_workers=1, image_size=4)


# ---- real CIFAR-10 images, when ../shared/data has them ----


@pytest.mark.skipif(not CIFAR_JPEG.is_file(), reason=f"real CIFAR-10 images not present at {CIFAR_JPEG}")
def test_cifar10_jpeg_as_image_folder(tmp_path: Path) -> None:
    with np.load(CIFAR_JPEG) as f:
        classes = [str(c) for c in f["classes"]]
        expected: dict[tuple[str, str], list[np.ndarray]] = {}
        for split, per_class in (("train", 15), ("test", 5)):
            jpeg, offsets, labels = f[f"{split}_jpeg"], f[f"{split}_offsets"], f[f"{split}_labels"]
            for c, name in enumerate(classes):
                for i in np.flatnonzero(labels == c)[:per_class]:
                    img = Image.open(io.BytesIO(jpeg[offsets[i] : offsets[i + 1]].tobytes())).convert("RGB")
                    path = tmp_path / split / name / f"{i:05d}.png"  # lossless: pixels must survive
                    path.parent.mkdir(parents=True, exist_ok=True)
                    img.save(path)
                    expected.setdefault((split, name), []).append(np.asarray(img))
        train_labels, test_labels = f["train_labels"].astype(np.int64), f["test_labels"].astype(np.int64)
    splits = load_image_folder(tmp_path)
    assert splits.train.classes == sorted(classes)
    assert splits.train.x.shape == (150, 32, 32, 3) and splits.test.x.shape == (50, 32, 32, 3)
    for split, ds in (("train", splits.train), ("test", splits.test)):
        np.testing.assert_array_equal(ds.x, np.stack([a for c in ds.classes for a in expected[split, c]]))
        np.testing.assert_array_equal(np.bincount(ds.y), [len(ds) // 10] * 10)
    # the paper's split on the real labels: 10 devices x k=4 -> 4 devices per class, 1250 each
    parts = split_k_classes(train_labels, n_clients=10, k=4, seed=0)
    assert [len(p) for p in parts] == [5000] * 10
    tests = assign_test_by_classes(parts, train_labels, test_labels, seed=0)
    assert [len(t) for t in tests] == [1000] * 10
