"""Data for FedPer: loaders to uint8 NHWC arrays, and seeded per-device partitions."""

from fedper.data.errors import DataError, UnreadableImage
from fedper.data.partition import (
    assign_test_by_classes,
    chance_accuracy,
    chance_words,
    split_dirichlet,
    split_k_classes,
    split_shards,
    split_train_test,
)
from fedper.data.sources import (
    ArrayDataset,
    DataSplits,
    dataset_name,
    load_cifar,
    load_digits,
    load_flickr_aes,
    load_image_folder,
    load_images,
    load_npz,
    read_image,
    skipping_unreadable_images,
    to_float_nchw,
)

__all__ = [
    "ArrayDataset",
    "DataError",
    "DataSplits",
    "UnreadableImage",
    "assign_test_by_classes",
    "chance_accuracy",
    "chance_words",
    "dataset_name",
    "load_cifar",
    "load_digits",
    "load_flickr_aes",
    "load_image_folder",
    "load_images",
    "load_npz",
    "read_image",
    "skipping_unreadable_images",
    "split_dirichlet",
    "split_k_classes",
    "split_shards",
    "split_train_test",
    "to_float_nchw",
]
