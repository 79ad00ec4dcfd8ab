"""The fleet's data: every image of a source as one normalized float tensor on the device, and each
client as two index arrays (train, test) into it, so batches are gathers rather than DataLoaders."""

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


@dataclass
class FleetData:
    x: torch.Tensor  # float32 NCHW, normalized, on the device
    y: torch.Tensor  # int64
    clients: list[tuple[torch.Tensor, torch.Tensor]]  # per client: (train indices, test indices) on the device
    classes: list[str]

    @property
    def input_size(self) -> int:
        return int(self.x.shape[-1])

    @property
    def n_train(self) -> list[int]:
        return [len(train) for train, _ in self.clients]


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


def _read_source(cfg: DataConfig) -> DataSplits | list[DataSplits]:
    if cfg.dataset == "digits":
        return load_digits(image_size=cfg.input_size or 32)
    if cfg.data is None:
        raise DataError(f"--dataset {cfg.dataset} needs --data PATH")
    path = Path(cfg.data)
    if cfg.dataset in ("cifar10", "cifar100"):
        return load_cifar(path, cfg.dataset)
    if cfg.dataset == "npz":
        return load_npz(path)
    if cfg.dataset == "imagefolder":
        return load_image_folder(path, cfg.input_size)
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


def _client_indices(cfg: DataConfig, source: DataSplits | list[DataSplits]) -> tuple[
    list[ArrayDataset], list[tuple[np.ndarray, np.ndarray]]
]:
    """The arrays to concatenate, and each client's (train, test) indices into their concatenation."""
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


def load_fleet_data(cfg: DataConfig, device: torch.device | str = "cpu") -> FleetData:
    """Read, partition and normalize a source, and move it to `device` once."""
    if not 0 < cfg.scale <= 1:
        raise DataError(f"--scale must lie in (0, 1], got {cfg.scale}")
    source = _read_source(cfg)
    arrays, indices = _client_indices(cfg, source)
    sizes = {a.x.shape[1:3] for a in arrays}
    if len(sizes) != 1:
        raise DataError(f"train and test images differ in size ({sorted(sizes)}); pass --input-size")
    x = torch.from_numpy(to_float_nchw(np.concatenate([a.x for a in arrays]), IMAGENET_MEAN, IMAGENET_STD))
    if cfg.input_size is not None and x.shape[-1] != cfg.input_size:
        x = torch.nn.functional.interpolate(x, size=(cfg.input_size,) * 2, mode="bilinear", align_corners=False)
    y = torch.from_numpy(np.concatenate([a.y for a in arrays]))
    empty = [i for i, (tr, te) in enumerate(indices) if len(tr) == 0 or len(te) == 0]
    if empty:
        raise DataError(f"client(s) {empty[:5]} got no train or no test samples; use fewer clients or a larger --scale")
    return FleetData(
        x=x.to(device),
        y=y.to(device),
        clients=[(torch.as_tensor(tr, device=device), torch.as_tensor(te, device=device)) for tr, te in indices],
        classes=list(arrays[0].classes),
    )
