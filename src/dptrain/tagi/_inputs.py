"""Validation at the boundary of a `Sequential`: what the user passes to forward and backward.

Shape legend: B batch, I input width (or C, H, W), N output width.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dptrain.tagi.states import DeltaStates, HiddenStates


def float_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return dtype


def as_input(mu_x: Any, var_x: Any, dtype: torch.dtype, device: torch.device,
             check_finite: bool, sample_shape: tuple[int, ...] | None = None, *,
             allow_empty: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mu (B, I...), var or None) as tensors of the network's dtype and device.

    With `sample_shape` (e.g. (C, H, W) of a first Conv2d) the flat forms (B, C·H·W) and
    (B·C·H·W,) that pytagi's loops pass are reshaped to (B, C, H, W). B = 0 only with
    `allow_empty` (a data-parallel rank without a sample in a step).
    """
    mu = _as_tensor(mu_x, "mu_x", dtype, device, check_finite, sample_shape, allow_empty)
    if var_x is None:
        return mu, None
    var = _as_tensor(var_x, "var_x", dtype, device, check_finite, sample_shape, allow_empty)
    if var.shape != mu.shape:
        raise ValueError(f"var_x must have the shape of mu_x {tuple(mu.shape)}, "
                         f"got {tuple(var.shape)}")
    if check_finite and not bool((var >= 0).all()):
        raise ValueError(f"var_x must be >= 0, got min {var.min().item()}")
    return mu, var


def _as_tensor(x: Any, name: str, dtype: torch.dtype, device: torch.device,
               check_finite: bool, sample_shape: tuple[int, ...] | None,
               allow_empty: bool = False) -> torch.Tensor:
    if isinstance(x, np.ndarray) and not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"{name} must be numeric, got dtype {x.dtype}")
    tensor = torch.as_tensor(x, dtype=dtype, device=device)
    if sample_shape is not None:
        tensor = _unflatten(tensor, name, sample_shape, allow_empty)
    if tensor.dim() < 2 or (tensor.shape[0] == 0 and not allow_empty):
        raise ValueError(f"{name} must have shape (batch, features...) with batch >= 1, "
                         f"got {tuple(tensor.shape)}")
    # One reduction instead of a full isfinite pass: a NaN/inf anywhere makes the sum
    # non-finite, and the exact search runs only then (a finite overflow finds nothing).
    if check_finite and not math.isfinite(tensor.sum().item()):
        bad = (~torch.isfinite(tensor)).nonzero()
        if len(bad):
            where = tuple(bad[0].tolist())
            raise ValueError(f"{name} contains {tensor[where].item()} at index {where} "
                             f"(of shape {tuple(tensor.shape)}); inputs must be finite")
    return tensor


def _unflatten(tensor: torch.Tensor, name: str, sample_shape: tuple[int, ...],
              allow_empty: bool = False) -> torch.Tensor:
    """(B, n) or (B·n,) with n = prod(sample_shape) → (B, *sample_shape); other shapes pass."""
    size = math.prod(sample_shape)
    flat_2d = tensor.dim() == 2 and tensor.shape[1] == size
    if tensor.dim() == 1 or flat_2d:
        if (tensor.numel() == 0 and not (allow_empty and flat_2d)) or tensor.numel() % size:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}: a flat input must hold "
                             f"whole samples of {'x'.join(map(str, sample_shape))} = {size} "
                             f"values (the first layer's input shape)")
        return tensor.reshape((-1,) + tuple(sample_shape))
    return tensor


def checked_output_delta(out: HiddenStates | None, delta: DeltaStates) -> DeltaStates:
    """The innovations the OutputUpdater wrote, checked against the last forward's output."""
    if out is None or delta.delta_mu is None or delta.delta_var is None:
        raise RuntimeError("backward() needs forward() and an OutputUpdater update first")
    for name in ("delta_mu", "delta_var"):
        got = getattr(delta, name)
        if got.shape != out.mu_a.shape:
            raise ValueError(f"input_delta_z_buffer.{name} has shape {tuple(got.shape)}, "
                             f"the last forward's output has {tuple(out.mu_a.shape)}")
    return delta
