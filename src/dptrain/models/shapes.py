"""Shapes the built-in families share: images in flat rows, initial-scale gains, a reshape."""

from __future__ import annotations

import math

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.spec import ModelOptions


def image_shape(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(C, H, W) of an image sample: the shape itself, or for flat rows of n values a square
    grey image (n = s²) or a square colour one (n = 3·s², channel-major); None otherwise."""
    if len(shape) == 3:
        c, h, w = shape
        return c, h, w
    if len(shape) != 1:
        return None
    n = shape[0]
    for c in (1, 3):
        side = math.isqrt(n // c)
        if n % c == 0 and side * side * c == n and side > 1:
            return c, side, side
    return None


def image(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """`image_shape`, or a ConfigError for inputs that are not images."""
    found = image_shape(shape)
    if found is None:
        raise ConfigError(f"inputs of shape {shape} are not images")
    return found


def flat_size(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def gains(options: ModelOptions, default: float = 1.0) -> tuple[float, float]:
    """TAGI's (weight, bias) gains of the initial standard deviations."""
    gw = options.gain_weight if options.gain_weight is not None else default
    gb = options.gain_bias if options.gain_bias is not None else gw
    return gw, gb


class Reshape(nn.Module):
    """(B, ...) -> (B, *shape): lets the image networks take flat rows too."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def image_input(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) of samples a model that takes images is given, or its one-line refusal."""
    found = image_shape(tuple(input_shape))
    if found is None:
        raise ConfigError(f"model {name} takes images (channels, height, width, or flat rows "
                          f"of a square image); the dataset's inputs have shape "
                          f"{tuple(input_shape)} (use a tagi-mlp or torch-mlp model)")
    return found
