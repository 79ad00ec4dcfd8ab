"""Data sources. Every loader returns uint8 NHWC RGB images and int64 labels, so that partitioning,
the emulator and the device agent share one in-memory format whatever the data came from."""

from __future__ import annotations

import csv
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from fedper.data.errors import DataError, UnreadableImage
from fedper.data.partition import split_train_test

# Files with other suffixes in a class folder (README, .DS_Store, ...) are ignored, not errors.
IMAGE_EXTENSIONS = frozenset(
    {".bmp", ".gif", ".jpeg", ".jpg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp"}
)
FLICKR_CSV = "FLICKR-AES_image_labeled_by_each_worker.csv"
FLICKR_IMAGES = "40K"
FLICKR_CLASSES = ["1", "2", "3", "4", "5"]
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}  # torchvision's base_folder
CIFAR_CLASS_COUNTS = {"cifar10": 10, "cifar100": 100}
# CIFAR-10's labels in order (torchvision's batches.meta), which is also their sorted order, so an image-folder
# copy of CIFAR-10 has the same label ids; a data set with exactly these classes is named CIFAR-10.
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DATASET_NAMES = {"digits": "digits (scikit-learn)", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100",
                 "flickr-aes": "FLICKR-AES"}

# While set (skipping_unreadable_images), image files that cannot be decoded are left out and listed here.
_skipped_images: ContextVar[list[Path] | None] = ContextVar("skipped_images", default=None)


@dataclass
class ArrayDataset:
    """Images and labels in memory; validated on construction so a bad source fails where it is read."""

    x: np.ndarray
    y: np.ndarray
    classes: list[str]

    def __post_init__(self) -> None:
        x, y = self.x, np.asarray(self.y)
        if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3:
            desc = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
            raise DataError(f"images must be a uint8 array of shape (N, H, W, 3), got {desc}")
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"labels must be a 1-D integer array, got {y.dtype} {y.shape}")
        if len(y) != len(x):
            raise DataError(f"{len(x)} images but {len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() >= len(self.classes)):
            raise DataError(
                f"labels span {y.min()}..{y.max()}, outside 0..{len(self.classes) - 1} "
                f"for {len(self.classes)} classes"
            )
        self.y = y.astype(np.int64, copy=False)
        self.classes = [str(c) for c in self.classes]

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        """The samples at `idx` (indices or a boolean mask), same classes, so label ids stay comparable."""
        return ArrayDataset(self.x[idx], self.y[idx], list(self.classes))


@dataclass
class DataSplits:
    train: ArrayDataset
    test: ArrayDataset | None  # None when the source has no test split


def to_float_nchw(x_uint8: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 NHWC -> float32 NCHW, (x/255 - mean)/std per channel (mean/std on the 0..1 scale, as in
    torchvision). One shared conversion, so the emulator, exporter and agent normalize identically."""
    x = np.asarray(x_uint8)
    if x.dtype != np.uint8 or x.ndim != 4:
        raise DataError(f"expected uint8 images of shape (N, H, W, C), got {x.dtype} {x.shape}")
    m, s = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    n_ch = x.shape[-1]
    if m.shape != (n_ch,) or s.shape != (n_ch,):
        raise DataError(f"mean {m.shape} and std {s.shape} must each hold {n_ch} values, one per channel")
    if np.any(s <= 0):
        raise DataError(f"std must be positive, got {s.tolist()}")
    # A 256-entry table per channel: one gather per pixel, computed in float64 and rounded once.
    lut = ((np.arange(256) / 255.0)[None, :] - m[:, None]) / s[:, None]
    lut = lut.astype(np.float32)
    out = np.empty((x.shape[0], n_ch, x.shape[1], x.shape[2]), np.float32)
    for ch in range(n_ch):
        out[:, ch] = lut[ch][x[..., ch]]
    return out


def load_cifar(
    root: str | Path, name: Literal["cifar10", "cifar100"] = "cifar10", download: bool = False
) -> DataSplits:
    """CIFAR-10/100 through torchvision: its download when online, or an existing root."""
    folders = CIFAR_FOLDERS
    if name not in folders:
        raise DataError(f"unknown CIFAR variant {name!r}; expected one of {sorted(folders)}")
    root = Path(root)
    if not download and not (root / folders[name]).is_dir():  # say so before the slow torchvision import
        raise DataError(
            f"{name} not found under {root} (looked for {root / folders[name]}); --data takes the folder "
            f"that holds {folders[name]}/ (torchvision's CIFAR download writes one), an .npz or an image folder"
        )
    from torchvision import datasets  # heavy; only this loader needs it

    cls = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}[name]
    try:
        splits = [cls(str(root), train=train, download=download) for train in (True, False)]
    except (RuntimeError, OSError) as e:
        action = f"download {name} into" if download else f"read {name} from"
        raise DataError(f"could not {action} {root / folders[name]}: {e}") from e
    train, test = (
        ArrayDataset(np.ascontiguousarray(d.data), np.asarray(d.targets, np.int64), list(d.classes))
        for d in splits
    )
    return DataSplits(train, test)


def _as_rgb(x: np.ndarray, key: str, path: Path) -> np.ndarray:
    """Accept (N,H,W) and (N,H,W,1) grayscale by replicating it, and (N,H,W,3) RGB, all uint8."""
    if x.dtype != np.uint8:
        raise DataError(f"{path}: {key} must be uint8 (0..255), got {x.dtype}; convert it before saving")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        hint = " (channels first? save it as NHWC)" if x.ndim == 4 and x.shape[1] in (1, 3) else ""
        raise DataError(f"{path}: {key} has shape {x.shape}, expected (N, H, W), (N, H, W, 1) or (N, H, W, 3){hint}")
    return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def load_npz(path: str | Path) -> DataSplits:
    """An .npz with x_train, y_train and optionally x_test, y_test and classes (label order)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no such .npz file: {path}")
    wanted = ("x_train", "y_train", "x_test", "y_test", "classes")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                present = sorted(loaded.files)
                arrays = {k: loaded[k] for k in wanted if k in present}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot read {path} as .npz: {e}") from e
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{path} holds a single array; expected an .npz with keys x_train, y_train, ...")
    missing = [k for k in ("x_train", "y_train") if k not in arrays]
    if missing:
        raise DataError(f"{path} lacks key(s) {missing}; it has {present}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path} has only one of x_test / y_test; give both or neither")
    parts = [("train", arrays["x_train"], arrays["y_train"])]
    if "x_test" in arrays:
        parts.append(("test", arrays["x_test"], arrays["y_test"]))
    checked = []
    for split, x, y in parts:
        x = _as_rgb(x, f"x_{split}", path)
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: y_{split} must be 1-D integers, got {y.dtype} {y.shape}")
        if len(x) != len(y):
            raise DataError(f"{path}: x_{split} has {len(x)} images but y_{split} has {len(y)} labels")
        checked.append((x, y))
    if len(checked) == 2 and checked[0][0].shape[1:] != checked[1][0].shape[1:]:
        raise DataError(
            f"{path}: train images are {checked[0][0].shape[1:3]} but test images {checked[1][0].shape[1:3]}"
        )
    if "classes" in arrays:
        if arrays["classes"].ndim != 1:
            raise DataError(f"{path}: classes must be 1-D, got shape {arrays['classes'].shape}")
        classes = [str(c) for c in arrays["classes"]]
    else:
        top = max((int(y.max()) for _, y in checked if len(y)), default=-1)
        classes = [str(i) for i in range(top + 1)]
    try:
        datasets = [ArrayDataset(x, y, classes) for x, y in checked]
    except DataError as e:
        raise DataError(f"{path}: {e}") from e
    return DataSplits(datasets[0], datasets[1] if len(datasets) == 2 else None)


@contextmanager
def skipping_unreadable_images() -> Iterator[list[Path]]:
    """Within it, image folders leave out the files that cannot be decoded, instead of stopping at the first
    one; yields the list of the files left out, so the caller can count and name them. One corrupt image
    among hundreds on a device then costs that image, not the device's participation."""
    skipped: list[Path] = []
    token = _skipped_images.set(skipped)
    try:
        yield skipped
    finally:
        _skipped_images.reset(token)


def read_image(path: Path, image_size: int | None) -> np.ndarray:
    """One image as uint8 HxWx3; any decoding failure becomes an UnreadableImage naming the file."""
    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB")  # convert() forces a full decode, so truncated files fail here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise UnreadableImage(f"cannot read image {path}: {e}") from e
    if image_size is not None:
        rgb = rgb.resize((image_size, image_size), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8)


def _stack(images: list[np.ndarray], files: list[Path]) -> np.ndarray:
    """Stack images that must share a size, naming the first file that does not."""
    for arr, f in zip(images, files, strict=True):
        if arr.shape != images[0].shape:
            raise DataError(
                f"{f} is {arr.shape[1]}x{arr.shape[0]} but {files[0]} is {images[0].shape[1]}x"
                f"{images[0].shape[0]}; pass image_size to resize them all"
            )
    return np.stack(images)


def _class_dirs(folder: Path) -> list[str]:
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise DataError(f"no class folders in {folder}")
    return names


def _read_tree(
    folder: Path, classes: list[str], image_size: int | None
) -> tuple[list[np.ndarray], list[Path], list[int]]:
    """Read folder/<class>/* for the class folders present; labels index `classes`."""
    images, files, labels = [], [], []
    for name in _class_dirs(folder):
        if name not in classes:
            raise DataError(f"{folder / name} is a class absent from the training folder (classes {classes})")
        found = sorted(
            p for p in (folder / name).iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not found:
            raise DataError(f"class folder {folder / name} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        read = [(p, image) for p in found if (image := _read_or_skip(p, image_size)) is not None]
        if not read:
            raise DataError(f"class folder {folder / name}: none of its {len(found)} images can be read")
        images += [image for _, image in read]
        files += [p for p, _ in read]
        labels += [classes.index(name)] * len(read)
    return images, files, labels


def _read_or_skip(path: Path, image_size: int | None) -> np.ndarray | None:
    """read_image, or None for an unreadable file while skipping_unreadable_images() is on (it is recorded)."""
    skipped = _skipped_images.get()
    try:
        return read_image(path, image_size)
    except UnreadableImage:
        if skipped is None:
            raise
        skipped.append(path)
        return None


def load_image_folder(root: str | Path, image_size: int | None = None) -> DataSplits:
    """root/train/<class>/* (+ optional root/test/<class>/*), or root/<class>/* with test=None.

    Classes are the training class folders sorted by name. Without image_size all images must share
    one size; with it, each is resized (bilinear) to image_size x image_size."""
    root = Path(root)
    if root.is_file():
        raise DataError(f"{root} is a file, not an image folder (<class>/* or train/<class>/*); "
                        f"an .npz of arrays is read by its .npz suffix")
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    if image_size is not None and image_size < 1:
        raise DataError(f"image_size must be >= 1, got {image_size}")
    train_dir = root / "train" if (root / "train").is_dir() else root
    classes = _class_dirs(train_dir)
    trees = [_read_tree(train_dir, classes, image_size)]
    if train_dir != root and (root / "test").is_dir():
        trees.append(_read_tree(root / "test", classes, image_size))
    x_all = _stack([im for t in trees for im in t[0]], [f for t in trees for f in t[1]])
    datasets, start = [], 0
    for images, _, labels in trees:
        datasets.append(ArrayDataset(x_all[start : start + len(images)], np.asarray(labels, np.int64), classes))
        start += len(images)
    return DataSplits(datasets[0], datasets[1] if len(datasets) == 2 else None)


def load_images(path: str | Path, *, cifar: str | None = None, image_size: int | None = None,
                option: str = "--data") -> DataSplits:
    """The images at `path`, read by what the path is: an .npz file, an image folder, or (when `cifar` names
    cifar10 or cifar100) torchvision's CIFAR files under a root or in their own folder. Errors name
    `option`, the command's option that gave the path."""
    path = Path(path).expanduser()
    accepted = "an .npz, an image folder (<class>/* or train/<class>/*)"
    if cifar is not None:
        accepted += f" or a {cifar} root (the folder that holds {CIFAR_FOLDERS[cifar]}/)"
    if not path.exists():
        raise DataError(f"{option} {path} does not exist; give {accepted}")
    if path.is_file():
        if path.suffix.lower() != ".npz":
            raise DataError(f"{option} {path} is a file but not an .npz; give {accepted}")
        splits = load_npz(path)
    elif cifar is not None and (path.name == CIFAR_FOLDERS[cifar] or (path / CIFAR_FOLDERS[cifar]).is_dir()):
        splits = load_cifar(path.parent if path.name == CIFAR_FOLDERS[cifar] else path, cifar)  # type: ignore[arg-type]
    elif not any(p.is_dir() and not p.name.startswith(".") for p in path.iterdir()):
        raise DataError(f"{option} {path} holds no folders; give {accepted}")
    else:
        splits = load_image_folder(path, image_size)
    if cifar is not None and len(splits.train.classes) != CIFAR_CLASS_COUNTS[cifar]:
        raise DataError(f"{option} {path} holds {len(splits.train.classes)} classes, not {cifar}'s "
                        f"{CIFAR_CLASS_COUNTS[cifar]}; other data sets are read with --dataset npz or imagefolder")
    return splits


def dataset_name(dataset: str, classes: Sequence[str], data: str | Path | None = None) -> str:
    """What a data set is, for titles: CIFAR-10 whatever file it came in (an .npz or an image folder with
    CIFAR-10's classes is CIFAR-10), else the name of the source or of the file it came from."""
    if tuple(classes) == CIFAR10_CLASSES:
        return DATASET_NAMES["cifar10"]
    if dataset in DATASET_NAMES:
        return DATASET_NAMES[dataset]
    return Path(data).name if data else dataset


def load_digits(image_size: int = 32) -> DataSplits:
    """scikit-learn's bundled digits (1,797 real 8x8 scans, 0..16): the zero-download demo data."""
    from sklearn.datasets import load_digits as sk_load_digits  # optional extra; only this loader needs it

    if image_size < 1:
        raise DataError(f"image_size must be >= 1, got {image_size}")
    digits = sk_load_digits()
    small = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    if image_size != small.shape[1]:
        size = (image_size, image_size)
        small = np.stack([np.asarray(Image.fromarray(im).resize(size, Image.Resampling.BILINEAR)) for im in small])
    x = np.repeat(small[..., None], 3, axis=-1)
    return DataSplits(ArrayDataset(x, digits.target.astype(np.int64), [str(d) for d in range(10)]), None)


def _read_flickr_ratings(csv_path: Path) -> dict[str, list[tuple[str, int]]]:
    """worker -> [(imagePair, label)], label = score - 1."""
    ratings: dict[str, list[tuple[str, int]]] = {}
    with csv_path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in ("worker", "imagePair", "score") if c not in header]
        if missing:
            raise DataError(f"{csv_path} lacks column(s) {missing}; its header is {header}")
        cols = [header.index(c) for c in ("worker", "imagePair", "score")]
        for line, row in enumerate(reader, start=2):
            if not any(cell.strip() for cell in row):
                continue
            try:
                worker, image, score_text = (row[c].strip() for c in cols)
                score = float(score_text)
            except (IndexError, ValueError) as e:
                raise DataError(f"{csv_path} line {line}: cannot parse {row}: {e}") from e
            if score not in (1, 2, 3, 4, 5):
                raise DataError(f"{csv_path} line {line}: score {score_text!r} is not an integer 1..5")
            ratings.setdefault(worker, []).append((image, int(score) - 1))
    return ratings


def load_flickr_aes(
    root: str | Path,
    n_workers: int = 30,
    min_ratings: int = 60,
    max_ratings: int = 290,
    image_size: int = 224,
    seed: int = 0,
) -> list[DataSplits]:
    """FLICKR-AES as the paper uses it: one device per worker who rated min..max images, n_workers
    of them drawn at random (seeded), labels score-1 in 5 classes, an 80/20 split per worker
    (stratified as far as the counts allow). Workers come back in worker-id order."""
    root = Path(root)
    csv_path = root / FLICKR_CSV
    if not csv_path.is_file():
        raise DataError(f"FLICKR-AES ratings file not found: {csv_path}")
    if n_workers < 1 or image_size < 1:
        raise DataError(f"n_workers and image_size must be >= 1, got {n_workers} and {image_size}")
    ratings = _read_flickr_ratings(csv_path)
    qualified = sorted(w for w, r in ratings.items() if min_ratings <= len(r) <= max_ratings)
    if len(qualified) < n_workers:
        raise DataError(
            f"only {len(qualified)} of {len(ratings)} workers in {csv_path} rated {min_ratings}..{max_ratings} "
            f"images; {n_workers} requested"
        )
    rng = np.random.default_rng(seed)
    chosen = [qualified[i] for i in np.sort(rng.choice(len(qualified), n_workers, replace=False))]
    counts = [len(ratings[w]) for w in chosen]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    labels = np.array([label for w in chosen for _, label in ratings[w]], np.int64)
    parts = [np.arange(offsets[i], offsets[i + 1]) for i in range(n_workers)]
    splits = split_train_test(parts, labels, test_fraction=0.2, seed=seed)
    out = []
    for w, start, (train_idx, test_idx) in zip(chosen, offsets[:-1], splits, strict=True):
        images = []
        for name, _ in ratings[w]:
            path = root / FLICKR_IMAGES / name
            if not path.is_file():
                raise DataError(f"FLICKR-AES image not found: {path} (rated by worker {w} in {csv_path})")
            images.append(read_image(path, image_size))
        worker = ArrayDataset(np.stack(images), labels[start : start + len(images)], FLICKR_CLASSES)
        out.append(DataSplits(worker.subset(train_idx - start), worker.subset(test_idx - start)))
    return out

