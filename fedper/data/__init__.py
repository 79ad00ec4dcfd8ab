"""Data for FedPer: loaders to uint8 NHWC arrays, and seeded per-device partitions."""

from fedper.data.errors import DataError
from fedper.data.partition import (
    assign_test_by_classes,
    split_dirichlet,
    split_k_classes,
    split_shards,
    split_train_test,
)
from fedper.data.sources import (
    ArrayDataset,
    DataSplits,
    load_cifar,
    load_digits,
    load_flickr_aes,
    load_image_folder,
    load_npz,
    to_float_nchw,
)

__all__ = [
    "ArrayDataset",
    "DataError",
    "DataSplits",
    "assign_test_by_classes",
    "load_cifar",
    "load_digits",
    "load_flickr_aes",
    "load_image_folder",
    "load_npz",
    "split_dirichlet",
    "split_k_classes",
    "split_shards",
    "split_train_test",
    "to_float_nchw",
]
