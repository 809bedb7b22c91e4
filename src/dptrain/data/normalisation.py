"""A split's normalisation as a record, and a split moved to another normalisation.

A model is trained in the input space its run's normalisation made: a run that starts from
another run's weights (`dptrain train --init-from`) keeps that run's normalisation, so its
new data are normalised with the source's statistics, not their own.

    from dptrain.data.normalisation import as_record, from_record, renormalised

    record = as_record(source.x_norm, source.y_norm)     # JSON: kept in the run's record
    x_norm, y_norm = from_record(record)
    split = renormalised(new_split, x_norm, y_norm)      # new data in the source's space
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from dptrain.data.datasets.base import ArrayDataset, Normalisation, Split
from dptrain.errors import ConfigError


def _tensor_record(t: torch.Tensor) -> dict[str, Any]:
    # float32 values written as Python floats read back bit-identical
    return {"shape": list(t.shape), "values": t.double().reshape(-1).tolist(),
            "dtype": str(t.dtype).removeprefix("torch.")}


def _tensor_from(record: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, record["dtype"])
    return torch.tensor(record["values"], dtype=torch.float64).to(dtype).reshape(
        record["shape"])


def as_record(x_norm: Normalisation | None, y_norm: Normalisation | None) -> dict[str, Any]:
    """JSON values of both normalisations (None where the data had none)."""
    def one(norm: Normalisation | None) -> dict[str, Any] | None:
        if norm is None:
            return None
        return {"mean": _tensor_record(norm.mean), "std": _tensor_record(norm.std)}

    return {"x_norm": one(x_norm), "y_norm": one(y_norm)}


def from_record(record: dict[str, Any]) -> tuple[Normalisation | None, Normalisation | None]:
    """The (x_norm, y_norm) of `as_record`."""
    def one(part: dict[str, Any] | None) -> Normalisation | None:
        if part is None:
            return None
        return Normalisation(_tensor_from(part["mean"]), _tensor_from(part["std"]))

    return one(record.get("x_norm")), one(record.get("y_norm"))


def renormalised(split: Split, x_norm: Normalisation | None,
                 y_norm: Normalisation | None) -> Split:
    """`split` with its inputs normalised by `x_norm` instead of its own (and, for regression,
    its targets by `y_norm`). A split without a normalisation of its own (your dataset file's)
    is taken as the network should see it and left as it is."""
    if split.x_norm is None or x_norm is None:
        return split
    if split.series is not None:
        raise ConfigError(f"{split.name}: a time series keeps its own normalisation; starting "
                          f"from another run's weights is for arrays and images")
    try:
        torch.broadcast_shapes(x_norm.mean.shape, x_norm.std.shape, split.input_shape)
    except RuntimeError:
        raise ConfigError(f"{split.name}: inputs {split.input_shape} do not fit the other "
                          f"run's input normalisation (statistics of shape "
                          f"{tuple(x_norm.mean.shape)})") from None
    x_norm = x_norm.to(split.x_norm.mean.dtype)
    y_norm = y_norm if split.task == "regression" and split.y_norm is not None else None
    if _same(x_norm, split.x_norm) and (y_norm is None or _same(y_norm, split.y_norm)):
        return split  # the source's own data: its tensors as they were, bit for bit
    parts = {name: _moved(getattr(split, name), split, x_norm, y_norm)
             for name in ("train", "test", "validation") if getattr(split, name) is not None}
    return dataclasses.replace(split, **parts, x_norm=x_norm,
                               y_norm=y_norm if y_norm is not None else split.y_norm)


def _same(a: Normalisation, b: Normalisation) -> bool:
    return all(s.shape == t.shape and torch.equal(s, t.to(s.dtype))
               for s, t in ((a.mean, b.mean), (a.std, b.std)))


def _moved(dataset: Any, split: Split, x_norm: Normalisation,
           y_norm: Normalisation | None) -> Any:
    if hasattr(dataset, "norm"):  # images normalised as they are read: give them the new map
        moved = copy.copy(dataset)
        moved.norm = x_norm
        return moved
    if not isinstance(dataset, ArrayDataset):
        raise ConfigError(f"{split.name}: its {type(dataset).__name__} cannot take another "
                          f"run's input normalisation (arrays and images can)")
    x = x_norm.apply(split.x_norm.invert(dataset.x)).to(dataset.x.dtype)
    y = dataset.y
    if y_norm is not None:
        y = y_norm.apply(split.y_norm.invert(y)).to(y.dtype)
    return ArrayDataset(x, y)
