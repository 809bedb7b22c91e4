"""`DataSpec`: what a model is built for, without the data: the shape and dtype of one input,
the task and its outputs, how raw values were normalised, the vocabulary of token data and
the layout of a time series' windows.

A run keeps it (`dptrain.models.card`), so that its model is rebuilt, and inputs mapped to
outputs, from the run alone.

    data = DataSpec.of(split)                   # while the data are at hand
    model, kind = create_model(config, data, seed=0)
    DataSpec.from_json(data.to_json())          # the same, read back from the run
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dptrain.data import Split
from dptrain.data.datasets.base import Normalisation
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.data.normalisation import as_record, from_record
from dptrain.models.shapes import image_shape


@dataclass(frozen=True, eq=False)
class SeriesLayout:
    """How a time series' windows are laid out: what a forecasting model was built for."""

    names: tuple[str, ...]
    """The series, in the order of their ids (an embedded series id indexes this)."""
    lookback: int
    horizon: int
    num_features: int
    """Values per time step: the series' own and its known covariates'."""
    covariate_names: tuple[str, ...] = ()
    with_ids: bool = False
    """Each window is followed by its series' id (`--series-embedding`)."""
    norm: Normalisation | None = None
    """Each series' scaling, fitted on its training part."""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, norm=None))
        out["norm"] = as_record(self.norm, None)["x_norm"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SeriesLayout:
        norm = from_record({"x_norm": data.get("norm")})[0]
        return cls(names=tuple(data["names"]), lookback=data["lookback"],
                   horizon=data["horizon"], num_features=data["num_features"],
                   covariate_names=tuple(data.get("covariate_names", ())),
                   with_ids=data.get("with_ids", False), norm=norm)


@dataclass(frozen=True, eq=False)
class DataSpec:
    """The data a model was built for, as far as the model needs to know it."""

    name: str
    task: str
    num_classes: int | None
    num_targets: int | None
    """Regression: targets per sample; None for classification."""
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype = torch.float32
    x_norm: Normalisation | None = None
    y_norm: Normalisation | None = None
    vocabulary: Vocabulary | None = None
    series: SeriesLayout | None = None
    unknown_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    class_names: tuple[str, ...] | None = None
    """Classification: each class's name (an image folder's class folders, else its id)."""

    @classmethod
    def of(cls, split: Split) -> DataSpec:
        series = split.series
        layout = None if series is None else SeriesLayout(
            names=tuple(series.names), lookback=series.lookback, horizon=series.horizon,
            num_features=series.num_features,
            covariate_names=tuple(getattr(series, "covariate_names", ()) or ()),
            with_ids=series.with_ids, norm=series.norm)
        classification = split.task == "classification"
        return cls(name=split.name, task=split.task, num_classes=split.num_classes,
                   num_targets=None if classification else split.output_dim,
                   input_shape=tuple(split.input_shape), input_dtype=input_dtype(split),
                   x_norm=split.x_norm, y_norm=split.y_norm, vocabulary=split.vocabulary,
                   series=layout, unknown_tokens=dict(split.unknown_tokens),
                   class_names=class_names(split))

    @property
    def kinds(self) -> frozenset[str]:
        """The data kinds (`dptrain.models.spec.DATA_KINDS`) these inputs are."""
        if self.vocabulary is not None:
            return frozenset({"tokens"})
        if self.series is not None:
            return frozenset({"series"})
        if len(self.input_shape) == 3:
            return frozenset({"images"})
        is_image = image_shape(self.input_shape) is not None
        return frozenset({"features", "images"} if is_image else {"features"})

    @property
    def output_dim(self) -> int:
        """Number of classes, or number of regression targets."""
        return self.num_classes if self.num_classes is not None else int(self.num_targets)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "task": self.task, "num_classes": self.num_classes,
                "num_targets": self.num_targets, "input_shape": list(self.input_shape),
                "input_dtype": str(self.input_dtype).removeprefix("torch."),
                "normalisation": as_record(self.x_norm, self.y_norm),
                "vocabulary": None if self.vocabulary is None else self.vocabulary.to_json(),
                "series": None if self.series is None else self.series.to_json(),
                "unknown_tokens": dict(self.unknown_tokens),
                "class_names": None if self.class_names is None else list(self.class_names)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DataSpec:
        x_norm, y_norm = from_record(data["normalisation"])
        vocabulary = data.get("vocabulary")
        series = data.get("series")
        return cls(name=data["name"], task=data["task"], num_classes=data["num_classes"],
                   num_targets=data["num_targets"], input_shape=tuple(data["input_shape"]),
                   input_dtype=getattr(torch, data["input_dtype"]), x_norm=x_norm,
                   y_norm=y_norm,
                   vocabulary=None if vocabulary is None else Vocabulary.from_json(vocabulary),
                   series=None if series is None else SeriesLayout.from_json(series),
                   unknown_tokens=dict(data.get("unknown_tokens", {})),
                   class_names=None if data.get("class_names") is None
                   else tuple(data["class_names"]))


def input_dtype(split: Split) -> torch.dtype:
    """The dtype of the split's inputs (int64 for token ids), from its first sample."""
    x = getattr(split.train, "x", None)
    if isinstance(x, torch.Tensor):
        return x.dtype
    return torch.as_tensor(split.train[0][0]).dtype


def class_names(split: Split) -> tuple[str, ...] | None:
    """An image folder's class folder names, else the class ids; None for regression."""
    if split.num_classes is None:
        return None
    files = getattr(split.test, "files", None)
    named = getattr(files, "classes", None)
    return tuple(named) if named else tuple(str(c) for c in range(split.num_classes))
