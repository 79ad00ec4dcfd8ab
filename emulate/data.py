"""The fleet's data: every image of a source resident on the device (as uint8 pixels, normalized per
batch on the device, or as one normalized float tensor), and each client as two index arrays (train,
test) into it, so batches are gathers rather than DataLoaders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedper.data import (
    ArrayDataset,
    DataError,
    DataSplits,
    assign_test_by_classes,
    chance_accuracy,
    dataset_name,
    load_digits,
    load_flickr_aes,
    load_images,
    split_dirichlet,
    split_k_classes,
    split_shards,
    split_train_test,
    to_float_nchw,
)
from fedper.models import IMAGENET_MEAN, IMAGENET_STD

DATASETS = ("digits", "cifar10", "cifar100", "npz", "imagefolder", "flickr-aes")
PARTITIONS = ("classes", "shards", "dirichlet")
TEST_FRACTION = 0.2  # the paper's 80/20 split of each device's data when the source has no test split


# The paper's settings that differ by data set (CIFAR: N = 10 clients, batch 128).
PAPER_CLIENTS = {"flickr-aes": 30}
PAPER_BATCH = {"flickr-aes": 4}


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "digits"
    data: str | None = None  # a path; digits needs none
    clients: int = 10
    classes_per_client: int = 4
    partition: str = "classes"
    shards: int = 2
    alpha: float = 0.5
    input_size: int | None = None  # None: the data's own size (digits: 32)
    scale: float = 1.0  # fraction of the samples kept (seeded, per class)
    seed: int = 0


class ResidentImages:
    """uint8 NCHW pixels on the device that index like the normalized float tensor they stand for:
    `images[idx]` gathers the batch's pixels and maps each through its channel's 256-entry table
    (fedper.data.to_float_nchw's, computed in float64 and rounded once to float32), so a batch holds
    exactly the values the float tensor would, at a quarter of its memory (CIFAR-10: 184 MB, not 737)
    and with no normalization on the host. `to(dtype)` changes the batches' dtype (float64 in tests:
    the float32 values, widened, as the float tensor's `.double()` gives)."""

    def __init__(self, pixels: torch.Tensor, table: torch.Tensor) -> None:
        self.pixels, self.table = pixels, table  # [N, C, H, W] uint8; [C, 256] float
        self._offsets = (torch.arange(table.shape[0], device=pixels.device) * 256).view(-1, 1, 1)
        self._flat = table.reshape(-1)

    @classmethod
    def from_nhwc(cls, x_uint8: np.ndarray, mean, std, device: torch.device | str = "cpu") -> ResidentImages:
        pixels = torch.from_numpy(np.ascontiguousarray(np.asarray(x_uint8).transpose(0, 3, 1, 2)))
        n_ch = pixels.shape[1]
        table = torch.from_numpy(to_float_nchw(np.arange(256, dtype=np.uint8).reshape(1, 1, 256, 1).repeat(n_ch, 3),
                                               mean, std)[0, :, 0, :])  # the shared conversion of 0..255
        return cls(pixels.to(device), table.to(device))

    def __getitem__(self, idx) -> torch.Tensor:
        batch = self.pixels[idx]
        return self._flat[batch.long() + self._offsets]

    def __len__(self) -> int:
        return len(self.pixels)

    @property
    def shape(self) -> torch.Size:
        return self.pixels.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @property
    def device(self) -> torch.device:
        return self.pixels.device

    def data_ptr(self) -> int:
        return self.pixels.data_ptr()

    def to(self, dtype: torch.dtype) -> ResidentImages:
        return ResidentImages(self.pixels, self.table.to(dtype))

    def double(self) -> ResidentImages:
        return self.to(torch.float64)

    def float(self) -> ResidentImages:
        return self.to(torch.float32)

    def equal(self, other: object) -> bool:
        return (isinstance(other, ResidentImages) and self.shape == other.shape and torch.equal(self.table, other.table)
                and torch.equal(self.pixels, other.pixels))


Images = torch.Tensor | ResidentImages  # what FleetData.x holds: both index into normalized float batches


def cat_images(parts: list[Images]) -> Images:
    """The images of `parts` one after another (stacked runs on different data, emulate/stacked.py)."""
    if all(isinstance(p, ResidentImages) for p in parts) and all(torch.equal(p.table, parts[0].table) for p in parts):
        return ResidentImages(torch.cat([p.pixels for p in parts]), parts[0].table)
    return torch.cat([p if isinstance(p, torch.Tensor) else p[:] for p in parts])


def same_images(a: Images, b: Images) -> bool:
    if isinstance(a, ResidentImages) or isinstance(b, ResidentImages):
        return isinstance(a, ResidentImages) and a.equal(b)
    return a.shape == b.shape and torch.equal(a, b)


@dataclass
class FleetData:
    x: Images  # NCHW, normalized by indexing: uint8 pixels (ResidentImages), or a float tensor (resized data, tests)
    y: torch.Tensor  # int64
    clients: list[tuple[torch.Tensor, torch.Tensor]]  # per client: (train indices, test indices) on the device
    classes: list[str]
    name: str = ""  # what the data set is, for titles (fedper.data.dataset_name): an .npz of CIFAR-10 is CIFAR-10

    @property
    def input_size(self) -> int:
        return int(self.x.shape[-1])

    @property
    def n_train(self) -> list[int]:
        return [len(train) for train, _ in self.clients]

    def chance_accuracy(self, personal: bool) -> float:
        """The label prior's accuracy on the clients' test splits (fedper.data.chance_accuracy)."""
        y = self.y.cpu().numpy()
        return chance_accuracy([y[test.cpu().numpy()] for _, test in self.clients], len(self.classes), personal)


def _thin(ds: ArrayDataset, scale: float, seed: int) -> ArrayDataset:
    """Keep round(scale * n_c) samples (at least 1) of every class c, drawn with a seed."""
    if scale >= 1.0:
        return ds
    rng = np.random.default_rng(seed)
    keep = [
        rng.permutation(np.flatnonzero(ds.y == c))[: max(1, round(scale * int((ds.y == c).sum())))]
        for c in np.unique(ds.y)
    ]
    return ds.subset(np.sort(np.concatenate(keep)))


def read_source(cfg: DataConfig) -> DataSplits | list[DataSplits]:
    """The data set `cfg` names, as read from its --data path (a CIFAR root, an .npz or an image folder, by
    what the path is), before any partition."""
    if cfg.dataset == "digits":
        return load_digits(image_size=cfg.input_size or 32)
    if cfg.dataset not in DATASETS:
        raise DataError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(DATASETS)}")
    if cfg.data is None:
        raise DataError(f"--dataset {cfg.dataset} needs --data PATH")
    path = Path(cfg.data).expanduser()
    if cfg.dataset in ("cifar10", "cifar100", "npz", "imagefolder"):
        cifar = cfg.dataset if cfg.dataset.startswith("cifar") else None
        return load_images(path, cifar=cifar, image_size=cfg.input_size)
    if cfg.dataset == "flickr-aes":
        return load_flickr_aes(path, n_workers=cfg.clients, image_size=cfg.input_size or 224, seed=cfg.seed)
    raise DataError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(DATASETS)}")


def _partition(cfg: DataConfig, labels: np.ndarray) -> list[np.ndarray]:
    if cfg.partition == "classes":
        return split_k_classes(labels, cfg.clients, cfg.classes_per_client, cfg.seed)
    if cfg.partition == "shards":
        return split_shards(labels, cfg.clients, cfg.shards, cfg.seed)
    if cfg.partition == "dirichlet":
        return split_dirichlet(labels, cfg.clients, cfg.alpha, cfg.seed)
    raise DataError(f"unknown partition {cfg.partition!r}; choose one of {', '.join(PARTITIONS)}")


def client_split(cfg: DataConfig, source: DataSplits | list[DataSplits]) -> tuple[
    list[ArrayDataset], list[tuple[np.ndarray, np.ndarray]]
]:
    """The arrays to concatenate, and each client's (train, test) indices into their concatenation; a split
    that leaves a client without training or test samples is refused, saying which options change it."""
    arrays, indices = _client_indices(cfg, source)
    empty = [i for i, (tr, te) in enumerate(indices) if len(tr) == 0 or len(te) == 0]
    if empty:
        kept = sum(len(a) for a in arrays)
        by_classes = cfg.partition == "classes"
        split = f"k={cfg.classes_per_client} classes each" if by_classes else f"--partition {cfg.partition}"
        raise DataError(
            f"client(s) {', '.join(map(str, empty[:8]))}{' ...' if len(empty) > 8 else ''} of {len(indices)} would "
            f"get no training or no test samples: {kept} images of {cfg.dataset}"
            f"{f' (--scale {cfg.scale:g})' if cfg.scale < 1 else ''} split among {len(indices)} clients, {split}; "
            f"use a larger --scale, fewer --clients{' or a smaller --classes-per-client' if by_classes else ''}")
    return arrays, indices


def _client_indices(cfg: DataConfig, source: DataSplits | list[DataSplits]) -> tuple[
    list[ArrayDataset], list[tuple[np.ndarray, np.ndarray]]
]:
    if isinstance(source, list):  # FLICKR-AES: one device per worker, already split 80/20
        parts = [s for w in source for s in (_thin(w.train, cfg.scale, cfg.seed), _thin(w.test, cfg.scale, cfg.seed))]
        offsets = np.cumsum([0, *(len(p) for p in parts)])
        return parts, [
            (np.arange(offsets[2 * i], offsets[2 * i + 1]), np.arange(offsets[2 * i + 1], offsets[2 * i + 2]))
            for i in range(len(source))
        ]
    train = _thin(source.train, cfg.scale, cfg.seed)
    own = _partition(cfg, train.y)
    if source.test is None:
        return [train], split_train_test(own, train.y, TEST_FRACTION, cfg.seed)
    test = _thin(source.test, cfg.scale, cfg.seed)
    tests = assign_test_by_classes(own, train.y, test.y, cfg.seed)
    return [train, test], [(tr, te + len(train)) for tr, te in zip(own, tests, strict=True)]


def load_fleet_data(cfg: DataConfig, device: torch.device | str = "cpu", pixels: bool | None = None) -> FleetData:
    """Read and partition a source, and move it to `device` once: as uint8 pixels normalized per batch
    (ResidentImages; `pixels` None: on a GPU, whose memory and bandwidth it saves, while on a CPU the
    per-batch table gather costs about 5 % of a step), or as the normalized float32 tensor (always when
    --input-size resizes it). Either gives the same batches, bit for bit."""
    if not 0 < cfg.scale <= 1:
        raise DataError(f"--scale must lie in (0, 1], got {cfg.scale}")
    arrays, indices = client_split(cfg, read_source(cfg))
    sizes = {a.x.shape[1:3] for a in arrays}
    if len(sizes) != 1:
        raise DataError(f"train and test images differ in size ({sorted(sizes)}); pass --input-size")
    images = np.concatenate([a.x for a in arrays])
    resized = cfg.input_size is not None and images.shape[2] != cfg.input_size
    if not resized and (torch.device(device).type == "cuda" if pixels is None else pixels):
        x: Images = ResidentImages.from_nhwc(images, IMAGENET_MEAN, IMAGENET_STD, device)
    else:
        x = torch.from_numpy(to_float_nchw(images, IMAGENET_MEAN, IMAGENET_STD))
        if resized:
            x = torch.nn.functional.interpolate(x, size=(cfg.input_size,) * 2, mode="bilinear", align_corners=False)
        x = x.to(device)
    y = torch.from_numpy(np.concatenate([a.y for a in arrays]))
    return FleetData(
        x=x,
        y=y.to(device),
        clients=[(torch.as_tensor(tr, device=device), torch.as_tensor(te, device=device)) for tr, te in indices],
        classes=list(arrays[0].classes),
        name=dataset_name(cfg.dataset, arrays[0].classes, cfg.data),
    )
