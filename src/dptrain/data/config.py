"""`DataConfig`: which dataset a run trains on and how its training images are augmented.

    from dptrain.data.config import DataConfig, load_split

    split = load_split(DataConfig(dataset="cifar10:~/data/cifar", augment="auto"), seed=0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dptrain.data.datasets import Split, load_dataset
from dptrain.data.datasets.images import ImageDataset
from dptrain.errors import ConfigError
from dptrain.options import bad_value, cli


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The data of a run."""

    dataset: str = "digits"
    """digits, digits-image, diabetes, toy1d, toy1d-hetero, mnist:DIR, fashion-mnist:DIR,
    cifar10:DIR, csv:PATH, npz:PATH (see dptrain.data.load_dataset)."""
    augment: Literal["auto", "on", "off"] = field(default="auto", metadata=cli(
        negative="no-augment"))
    """Random crop (4-pixel black padding) and horizontal flip of training images: on, off, or
    auto (on where the dataset's published results use it: cifar10)."""

    def __post_init__(self) -> None:
        if self.augment not in ("auto", "on", "off"):
            raise bad_value(self, "augment", "on, off or auto")


def load_split(config: DataConfig, *, seed: int) -> Split:
    """The dataset, its training images augmented as `config` asks (draws seeded by `seed`)."""
    split = load_dataset(config.dataset)
    if config.augment == "off" or (config.augment == "auto" and not split.augment_by_default):
        return split
    if not isinstance(split.train, ImageDataset):
        raise ConfigError(f"--augment is for image datasets (mnist, cifar10); "
                          f"{config.dataset} has inputs {split.input_shape}")
    return split.with_train(split.train.with_augmentation(seed=seed))
