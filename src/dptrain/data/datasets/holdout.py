"""A validation part held out of a training part: `hold_out(split, size, seed)`.

    split = hold_out(load_dataset("digits"), 0.1, seed=0)   # 1293 train, 144 validation

The held-out samples are a seeded draw (`torch.randperm` under `seed`), the same in every
process whatever the world size, so every rank trains and validates on the same samples. Each
part keeps the dataset's own kind (in-memory arrays stay arrays gathered in one indexing,
images stay uint8, an image folder stays a file list), so augmentation, lazy decoding and the
loaders work on it as on the whole; the normalisation stays the one fitted on the whole
training part.
"""

from __future__ import annotations

import dataclasses

import torch

from dptrain.data.datasets.base import ArrayDataset, Split
from dptrain.data.datasets.image_folder import ImageFolderDataset
from dptrain.data.datasets.images import ImageDataset
from dptrain.data.datasets.sizes import count_of
from dptrain.errors import ConfigError


def subset(dataset: torch.utils.data.Dataset, indices: torch.Tensor
           ) -> torch.utils.data.Dataset:
    """The samples `indices` (int64, (K,)) of `dataset`, as a dataset of the same kind where
    dptrain knows it, else a `torch.utils.data.Subset`."""
    if isinstance(dataset, ImageFolderDataset):
        files, idx = dataset.files, indices.numpy()
        part = dataclasses.replace(files, paths=files.paths[idx], labels=files.labels[idx])
        return ImageFolderDataset(part, dataset.transform, dataset.channels, dataset.norm,
                                  skip_bad=dataset.skip_bad)
    if isinstance(dataset, ImageDataset):
        return ImageDataset(dataset.raw[indices], dataset.y[indices], dataset.norm,
                            augment_seed=dataset.augment_seed)
    if isinstance(dataset, ArrayDataset):
        x, y = dataset[indices]
        return ArrayDataset(x, y)
    return torch.utils.data.Subset(dataset, indices.tolist())


def hold_out(split: Split, size: int | float, *, seed: int, option: str = "val-size") -> Split:
    """`split` with `size` (a count, or a fraction of the training part) of its training
    samples moved to `split.validation`.

    Raises:
        ConfigError: `split` has a validation part already, or `size` leaves no training
            sample.
    """
    if split.validation is not None:
        raise ConfigError(f"{split.name}: has a validation part of its own "
                          f"({len(split.validation)} samples); nothing to hold out")
    total = len(split.train)
    count = count_of(size, total)
    if count >= total:
        raise ConfigError(f"--{option} {size}: the training part of {split.name} has {total} "
                          f"samples, and holding out {count} leaves none to train on")
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    validation, train = order[:count].sort().values, order[count:].sort().values
    return dataclasses.replace(split, train=subset(split.train, train),
                               validation=subset(split.train, validation))
