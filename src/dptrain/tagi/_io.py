"""Parameter files for `Sequential.save/load` and the checks behind `load_state_dict`.

A file is `torch.save` of a dict of plain tensors, strings and ints, read back with
`torch.load(weights_only=True)`, which refuses anything that would run pickled code.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dptrain.errors import CheckpointError

if TYPE_CHECKING:
    from dptrain.tagi.sequential import Sequential

FORMAT = "dptrain.tagi.Sequential"
VERSION = 1


def load_into(targets: list[tuple[str, torch.Tensor]], state: Mapping[str, Any]) -> None:
    """Validate `state` against the live `targets` completely, then copy it in."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict must be a mapping of names to tensors, got "
                         f"{type(state).__name__}")
    expected = [name for name, _ in targets]
    missing = [name for name in expected if name not in state]
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state_dict does not fit this network: missing keys {missing}, "
                         f"unexpected keys {unexpected}")
    values = []
    for name, target in targets:
        value = torch.as_tensor(state[name])
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, the network "
                             f"expects {tuple(target.shape)}")
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            raise ValueError(f"state_dict[{name!r}] must hold finite floating-point values")
        if name.rsplit(".", 1)[-1].startswith("var_") and not bool((value > 0).all()):
            raise ValueError(f"state_dict[{name!r}] holds variances <= 0 (min "
                             f"{value.min().item()})")
        if name.endswith(".num_batches_tracked") and \
                not bool(((value >= 0) & (value == value.round())).all()):
            raise ValueError(f"state_dict[{name!r}] must be a whole number >= 0, got "
                             f"{value.tolist()}")
        values.append(value)
    with torch.no_grad():
        for (_, target), value in zip(targets, values):
            target.copy_(value)


def save(path: str | os.PathLike[str], state: dict[str, torch.Tensor], architecture: str) -> None:
    """Write to `<path>.tmp`, then rename: a crash never leaves a half-written `path`."""
    payload = {"format": FORMAT, "version": VERSION, "architecture": architecture,
               "state_dict": {name: t.cpu() for name, t in state.items()}}
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load(path: str | os.PathLike[str], net: Sequential) -> None:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: no such parameter file") from err
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable {FORMAT} file: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} file")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {payload.get('version')!r}, this "
                              f"dptrain reads version {VERSION}")
    try:
        net.load_state_dict(payload["state_dict"])
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"{path}: saved from {payload.get('architecture')}, does not "
                              f"fit {net!r}: {err}") from err
