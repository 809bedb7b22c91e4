"""In-memory containers every reader returns: ArrayDataset, Normalisation, Split.

Conventions: inputs are float32 with the sample axis first; classification targets are int64
class ids of shape (N,); regression targets are float32 of shape (N, num_targets).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from dptrain.errors import ConfigError, DataError

Task = Literal["classification", "regression"]
IGNORE_INDEX = -100
"""A class-id target equal to this is left out of the loss and every metric: padding (torch's
cross-entropy default)."""
_TASKS = ("classification", "regression")


class ArrayDataset(torch.utils.data.Dataset):
    """Paired tensors `x` (N, ...) and `y` (N, ...); `ds[idx]` is `(x[idx], y[idx])`.

    `idx` may be an int (one sample, what a DataLoader asks for) or an index tensor/list (a
    whole batch in one gather, what `ShardedSampler.batches` feeds TAGI).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0]:
            raise DataError(f"ArrayDataset needs x and y with the same number of samples on "
                            f"axis 0, got x {tuple(x.shape)} and y {tuple(y.shape)}")
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's input shape."""
        return tuple(self.x.shape[1:])

    def __getitem__(self, idx: int | torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]

    def set_epoch(self, epoch: int) -> None:
        """Called before each epoch; datasets whose samples depend on it (augmentation draws)
        override it. Plain arrays are the same every epoch."""

    def series_of(self, indices: torch.Tensor) -> torch.Tensor | None:
        """The series samples `indices` belong to (`Batch.series`); None: not time series."""
        return None

    def __repr__(self) -> str:
        return (f"ArrayDataset(x={tuple(self.x.shape)} {self.x.dtype}, "
                f"y={tuple(self.y.shape)} {self.y.dtype})")


class Batch(tuple):
    """(inputs, targets), and the reasons of the samples left out of it (`skipped`: items a
    dataset could not read and said so with a `Skipped`, e.g. under `--bad-images skip`)."""

    skipped: tuple[str, ...] = ()
    series: torch.Tensor | None = None
    """(B,) int64: the series each sample's window comes from, for the learner's per-series
    metrics (windows of several time series, `WindowDataset.series_of`); None otherwise."""

    def pin_memory(self) -> Batch:
        """Page-locked copies (DataLoader's pin_memory calls this), `skipped` and `series`
        kept."""
        pinned = Batch(t.pin_memory() for t in self)
        pinned.skipped, pinned.series = self.skipped, self.series
        return pinned


@dataclass(frozen=True)
class Skipped:
    """An item a dataset could not read, and why (a one-line message naming the file)."""

    reason: str


@dataclass(frozen=True, eq=False)  # tensors: == would be ambiguous
class Normalisation:
    """The affine map applied to raw values: `normalised = (raw - mean) / std`.

    `mean` and `std` broadcast against one sample (or a batch of them).
    """

    mean: torch.Tensor
    std: torch.Tensor

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw - self.mean) / self.std

    def invert(self, normalised: torch.Tensor) -> torch.Tensor:
        return normalised * self.std + self.mean

    def to(self, dtype: torch.dtype) -> Normalisation:
        return Normalisation(self.mean.to(dtype), self.std.to(dtype))

    @classmethod
    def fit(cls, train: torch.Tensor, *, dim: int | tuple[int, ...] = 0) -> Normalisation:
        """Mean and std of the training part over `dim`; a constant column keeps std 1, so it
        is centred instead of divided by zero."""
        mean = train.mean(dim=dim, keepdim=True)
        std = train.std(dim=dim, keepdim=True, correction=0)
        std = torch.where(std > 0, std, torch.ones_like(std))
        # keepdim kept the sample axis; drop it so the stats broadcast against one sample too
        return cls(mean.squeeze(0), std.squeeze(0))


@dataclass(frozen=True, kw_only=True, eq=False)
class Split:
    """A fixed train/test split with what a model needs to know about it.

    `train` and `test` are map-style datasets: `dataset[i]` is one sample `(x, y)` (an
    `ArrayDataset` also takes a whole index tensor at once). Classification targets are class
    ids, regression targets float vectors of `output_dim`.

    Attributes:
        x_norm: how raw inputs were normalised (stats from the training part only); apply it
            to new raw inputs before predicting.
        y_norm: regression only: how targets were standardised; `y_norm.invert(pred)` gives
            predictions in the original units (e.g. for an RMSE that means something).
        fingerprint: of the files the data came from, when it was read lazily from many: every
            process of a job must see the same.
    """

    name: str
    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    task: Task
    num_classes: int | None
    x_norm: Normalisation | None = None
    y_norm: Normalisation | None = None
    augment_by_default: bool = False
    """Train with random crops and flips unless told otherwise (`DataConfig.augment` "auto"):
    the convention of the dataset's published results (CIFAR-10, ImageNet)."""
    fingerprint: str | None = None
    validation: torch.utils.data.Dataset | None = None
    """The part that chooses (early stopping, the best checkpoint), evaluated each epoch as
    `val_*` metrics; the test part only reports. A time series' time steps between its
    training and test part, an image folder's val/ beside its test/, your own; else None, and
    `dptrain train` holds one out of the training part (`--val-size`,
    `dptrain.data.datasets.holdout.hold_out`)."""
    series: Any = None
    """Time series only: the whole series (`dptrain.data.datasets.series.SeriesData`), for
    multi-step forecasts of the test part."""
    vocabulary: Any = None
    """Token data only (`text:`, `tokens:`): the `dptrain.data.datasets.vocabulary.Vocabulary`
    whose ids the windows hold; the run stores it as vocabulary.json."""
    unknown_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    """Token data only: characters outside the vocabulary met in each part ("validation",
    "test"), mapped to the unknown id and reported in summary.json."""

    def __post_init__(self) -> None:
        if self.task not in _TASKS:
            raise ConfigError(f"Split.task must be one of {_TASKS}, got {self.task!r}")
        if (self.task == "classification") != (self.num_classes is not None):
            raise ConfigError(f"Split.num_classes must be set for classification and None for "
                              f"regression, got task={self.task!r}, "
                              f"num_classes={self.num_classes!r}")
        if sample_shape(self.train) != sample_shape(self.test):
            raise DataError(f"{self.name}: train inputs have shape "
                            f"{(len(self.train), *sample_shape(self.train))} but test inputs "
                            f"{(len(self.test), *sample_shape(self.test))}")
        if self.validation is not None and sample_shape(self.validation) != self.input_shape:
            raise DataError(f"{self.name}: train inputs have shape "
                            f"{(len(self.train), *self.input_shape)} but validation inputs "
                            f"{(len(self.validation), *sample_shape(self.validation))}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's input shape, e.g. (64,) or (1, 8, 8)."""
        return sample_shape(self.train)

    def with_train(self, train: torch.utils.data.Dataset) -> Split:
        """The same split with another training set (e.g. augmented images)."""
        return dataclasses.replace(self, train=train)

    @property
    def output_dim(self) -> int:
        """Number of classes, or number of regression targets."""
        if self.num_classes is not None:
            return self.num_classes
        y = self.train.y if isinstance(self.train, ArrayDataset) else self.train[0][1][None]
        return int(y.reshape(len(y), -1).shape[1])

    def __repr__(self) -> str:
        kind = (f"{self.num_classes} classes" if self.num_classes is not None
                else f"{self.output_dim} target(s)")
        val = "" if self.validation is None else f", validation {len(self.validation)}"
        return (f"Split({self.name!r}, {self.task}, {kind}, input {self.input_shape}, "
                f"train {len(self.train)}{val}, test {len(self.test)})")


def sample_shape(dataset: torch.utils.data.Dataset) -> tuple[int, ...]:
    """One sample's input shape: declared by dptrain's datasets, else read off sample 0."""
    declared = getattr(dataset, "sample_shape", None)
    return tuple(declared) if declared is not None else tuple(dataset[0][0].shape)


def check_finite(values: np.ndarray | torch.Tensor, *, where: str) -> None:
    """Raise DataError naming `where` and the first NaN/inf position (row, column...)."""
    arr = values.numpy() if isinstance(values, torch.Tensor) else values
    bad = ~np.isfinite(arr)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{where}: {int(bad.sum())} NaN/inf value(s), the first "
                        f"{arr[pos]!r} at index {pos}")


def check_labels(labels: np.ndarray | torch.Tensor, num_classes: int, *, where: str) -> None:
    """Raise DataError naming `where` if any label is outside [0, num_classes)."""
    arr = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    bad = (arr < 0) | (arr >= num_classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{where}: labels must be in [0, {num_classes}), got {arr.flat[i]} at "
                        f"index {i} ({int(bad.sum())} out of range)")


def classification_split(name: str, x_train: torch.Tensor, y_train: torch.Tensor,
                         x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int,
                         x_norm: Normalisation) -> Split:
    """Normalise inputs with `x_norm` and package a classification split."""
    return Split(name=name, task="classification", num_classes=num_classes, x_norm=x_norm,
                 train=ArrayDataset(x_norm.apply(x_train).float(), y_train.long()),
                 test=ArrayDataset(x_norm.apply(x_test).float(), y_test.long()))


def regression_split(name: str, x_train: torch.Tensor, y_train: torch.Tensor,
                     x_test: torch.Tensor, y_test: torch.Tensor) -> Split:
    """Standardise inputs and targets with training statistics and package a regression split.

    Targets are made 2-D, (N,) -> (N, 1), because output layers produce (B, num_targets).
    """
    y_train = y_train.reshape(len(y_train), -1)
    y_test = y_test.reshape(len(y_test), -1)
    # Stats are fitted in the data's precision, then kept in float32 like the data, so that
    # `y_norm.invert(prediction)` does not silently change a float32 prediction's dtype.
    x_norm = Normalisation.fit(x_train).to(torch.float32)
    y_norm = Normalisation.fit(y_train).to(torch.float32)
    return Split(name=name, task="regression", num_classes=None, x_norm=x_norm, y_norm=y_norm,
                 train=ArrayDataset(x_norm.apply(x_train).float(), y_norm.apply(y_train).float()),
                 test=ArrayDataset(x_norm.apply(x_test).float(), y_norm.apply(y_test).float()))
