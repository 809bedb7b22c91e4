"""Conversions at the adapter's edge: torch tensors <-> pytagi's flat float32 numpy arrays, and
engine `state_dict` keys <-> pytagi's per-layer entries."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dptrain.tagi import Sequential as EngineSequential

PARAMS = ("mu_w", "var_w", "mu_b", "var_b")


def flat(tensor: torch.Tensor | None) -> np.ndarray:
    """A tensor as pytagi returns states: flat float32 numpy on the host."""
    if tensor is None:
        return np.zeros(0, dtype=np.float32)
    return tensor.detach().reshape(-1).to("cpu", torch.float32).numpy()


def pytagi_key(path: str, layer: object) -> str:
    """pytagi's state_dict key of the layer at engine path `path`: "<Type>.<index>" ("Linear.0"),
    a block's inner layer with the branch first ("Conv2d.main.3.0" for engine "3.main.0")."""
    parts = path.split(".")
    branches = [p for p in parts if p in ("main", "short")]
    indices = [p for p in parts if p not in ("main", "short")]
    return ".".join([type(layer).__name__, *branches, *indices])


def to_pytagi(net: EngineSequential) -> dict[str, tuple[list[float], ...]]:
    """{key: (mu_w, var_w, mu_b, var_b)} as lists of floats (pytagi's format; a layer without
    bias gets empty bias lists); BatchNorm running statistics are not part of it, as in pytagi."""
    state = dict(net.named_parameter_tensors())
    out = {}
    for path, leaf in net.named_leaves():
        out[pytagi_key(path, leaf)] = tuple(
            flat(state[f"{path}.{name}"]).astype(np.float64).tolist()
            if f"{path}.{name}" in state else [] for name in PARAMS)
    return out


def from_pytagi(net: EngineSequential, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The engine state_dict with pytagi's entries written in; raises ValueError naming a key
    that is missing, unknown, or of the wrong size."""
    state = net.state_dict()
    keys = {pytagi_key(path, leaf): path for path, leaf in net.named_leaves()}
    unknown = sorted(set(entries) - set(keys))
    missing = sorted(set(keys) - set(entries))
    if unknown or missing:
        raise ValueError(f"load_state_dict: keys do not fit this network: missing {missing}, "
                         f"unknown {unknown}")
    for key, path in keys.items():
        values = entries[key]
        if len(values) != 4:
            raise ValueError(f"load_state_dict: {key} must hold (mu_w, var_w, mu_b, var_b), "
                             f"got {len(values)} entries")
        for name, value in zip(PARAMS, values):
            target = f"{path}.{name}"
            array = np.asarray(value, dtype=np.float64)
            if target not in state:
                if array.size:
                    raise ValueError(f"load_state_dict: {key} has no {name} here, got "
                                     f"{array.size} values")
                continue
            if array.size != state[target].numel():
                raise ValueError(f"load_state_dict: {key} {name} needs "
                                 f"{state[target].numel()} values, got {array.size}")
            state[target] = torch.from_numpy(array).reshape(state[target].shape)
    return state
