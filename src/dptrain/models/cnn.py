"""The CNNs: tagi-cnn (pytagi's classification CNN), tagi-cnn-pytagi (the same as pytagi
initialises it) and torch-cnn, sized for images of 4x4 pixels and up (8x8, 28x28, 32x32 and
sizes in between)."""

from __future__ import annotations

from typing import Any

from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.shapes import Reshape, gains, image, image_input
from dptrain.models.spec import Family, ModelOptions, ModelSpec
from dptrain.tagi import AvgPool2d, Conv2d, Linear, ReLU, Sequential


def _cnn_plan(h: int, w: int) -> list[tuple[int, int, int, int]]:
    """(conv kernel, conv padding, pool kernel, pool stride) of the two stages.

    pytagi's MNIST CNN (kernels 4 and 5, padding 1 then 0, 3x3 pools with stride 2) for inputs
    of 24 pixels and more; on smaller images it would shrink them to nothing, so there it is
    scaled down to 3x3 'same' convolutions and 2x2 pools (8x8 -> 4x4 -> 2x2)."""
    if min(h, w) >= 24:
        return [(4, 1, 3, 2), (5, 0, 3, 2)]
    if min(h, w) >= 4:
        return [(3, 1, 2, 2), (3, 1, 2, 2)]
    raise ConfigError(f"the CNNs need images of at least 4x4 pixels, got {h}x{w}")


def _stage_out(size: int, conv_k: int, conv_p: int, pool_k: int, pool_s: int) -> int:
    size = size + 2 * conv_p - conv_k + 1
    return (size - pool_k) // pool_s + 1


CNN_GAIN = 0.5
"""tagi-cnn's default gain of the initial standard deviations on images of 24 pixels and more
(pytagi's MNIST layout). At pytagi's gain of 1, 12 of 40 runs on 28x28 digits (seeds 0-19,
σ_v 0.05 and 0.2, 3 epochs) and 4 of 20 on 32x32 colour digits ended at chance: the first few
updates drive every unit of the second convolution's ReLU negative for every input, which no
later update can undo (docs/tagi.md, Collapsed runs). At 0.5: none, and a lower median test
error. The small-image layout (8x8 digits) never collapsed at gain 1 and learns faster with
it, so it keeps 1 (bench/tagi/tagi_stability.py)."""


def cnn_default_gain(input_shape: tuple[int, ...]) -> float:
    """tagi-cnn's gain when the options set none: `CNN_GAIN` from 24 pixels up, else 1."""
    _, h, w = image(input_shape)
    return CNN_GAIN if min(h, w) >= 24 else 1.0


def tagi_cnn(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions,
             default_gain: float | None = None):
    """pytagi's classification CNN: Conv2d(C,16) - ReLU - AvgPool2d - Conv2d(16,32) - ReLU -
    AvgPool2d - Linear(., 100) - ReLU - Linear(100, num_outputs) (hidden 64 on small images),
    its initial standard deviations scaled by `CNN_GAIN` on images of 24 pixels and more unless
    the options (or `default_gain`) set a gain."""
    c, h, w = image(input_shape)
    hidden = 100 if min(h, w) >= 24 else 64
    if default_gain is None:
        default_gain = cnn_default_gain(input_shape)
    gw, gb = gains(options, default_gain)
    layers: list[Any] = []
    channels = c
    for out_c, (k, p, pk, ps) in zip((16, 32), _cnn_plan(h, w)):
        first = not layers
        layers += [Conv2d(channels, out_c, k, padding=p, gain_weight=gw, gain_bias=gb,
                          **({"in_width": w, "in_height": h} if first else {})),
                   ReLU(), AvgPool2d(pk, stride=ps)]
        channels = out_c
        h, w = _stage_out(h, k, p, pk, ps), _stage_out(w, k, p, pk, ps)
    return Sequential(*layers, Linear(channels * h * w, hidden, gain_weight=gw, gain_bias=gb),
                      ReLU(), Linear(hidden, num_outputs, gain_weight=gw, gain_bias=gb),
                      dtype=options.dtype)


def tagi_cnn_pytagi(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """tagi-cnn exactly as pytagi initialises it (gain 1), for comparisons with pytagi: 6 of 20
    runs collapse to chance on 28x28 digits (docs/tagi.md, Collapsed runs)."""
    return tagi_cnn(input_shape, num_outputs, options, default_gain=1.0)



def torch_cnn(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions,
              channels: int = 16):
    """Two 3x3 conv + BatchNorm + ReLU blocks and a linear head. On images of 16 pixels and
    more a 2x2 max-pool follows the first block; the last pool brings the map to 4x4 (8x8
    digits: a 2x2 max-pool, the layout of the original digits recipe)."""
    c, h, w = image(input_shape)
    if min(h, w) < 4:
        raise ConfigError(f"torch-cnn needs images of at least 4x4 pixels, got {h}x{w}")
    layers: list[nn.Module] = [Reshape((c, h, w)),
                               nn.Conv2d(c, channels, 3, padding=1), nn.BatchNorm2d(channels),
                               nn.ReLU()]
    if min(h, w) >= 16:
        layers.append(nn.MaxPool2d(2))
    layers += [nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels),
               nn.ReLU(), nn.AdaptiveMaxPool2d(4),
               nn.Flatten(), nn.Linear(2 * channels * 16, num_outputs)]
    return nn.Sequential(*layers)



def check_input(spec: ModelSpec, input_shape: tuple[int, ...]) -> None:
    _, h, w = image_input(spec.name, input_shape)
    if min(h, w) < 4:
        raise ConfigError(f"model {spec.name} needs images of at least 4x4 pixels; the "
                          f"dataset's are {h}x{w}")


FAMILY = Family(
    name="cnn",
    models=(ModelSpec("tagi-cnn", "tagi", tagi_cnn, "TAGI CNN (pytagi's classification CNN, "
                      "initial standard deviations x0.5 on 24 pixels and more)"),
            ModelSpec("tagi-cnn-pytagi", "tagi", tagi_cnn_pytagi, "TAGI CNN exactly as pytagi "
                      "initialises it (6 of 20 runs collapse on 28x28 digits)"),
            ModelSpec("torch-cnn", "torch", torch_cnn,
                      "torch CNN, 2 conv + BatchNorm blocks")),
    data=frozenset({"images"}), options=("gain_weight", "gain_bias"), check_input=check_input)
