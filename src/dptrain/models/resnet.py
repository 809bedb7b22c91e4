"""The ResNets: tagi-resnet18 (pytagi's), torch-resnet18 and torch-resnet50, with CIFAR's stem
on small images and ImageNet's from `IMAGENET_STEM_FROM` pixels a side."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.shapes import Reshape, gains, image, image_input
from dptrain.models.spec import Family, ModelOptions, ModelSpec
from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, Linear, MixtureReLU,
                          ResNetBlock, Sequential)


IMAGENET_STEM_FROM = 128
"""The ResNets take ImageNet's stem (a strided conv and a pool: 4x smaller maps) for images of
at least this many pixels a side, CIFAR's (one 3x3 conv at full size) below."""


def tagi_resnet18(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """pytagi's ResNet18: every 3x3 conv (no bias) followed by MixtureReLU then BatchNorm2d;
    the first block of stages 2-4 has stride 2 with padding_type 2 and a projection shortcut
    Conv2d(k=2, stride=2) + MixtureReLU + BatchNorm2d; no activation after the sum; AvgPool2d
    over the last feature map, Linear(8·width, num_outputs). The stem is pytagi's CIFAR-10 one
    (3x3 conv; 4x4 last map on 32x32) below `IMAGENET_STEM_FROM` pixels, its ImageNet one
    above: Conv2d(k=6, stride 2, padding 2) + MixtureReLU + BatchNorm2d + AvgPool2d(3, stride 2,
    padding 1 right and bottom); 7x7 last map on 224x224."""
    c, h, w = image(input_shape)
    gw, gb = gains(options)

    def conv(cin: int, cout: int, k: int = 3, stride: int = 1, padding: int = 1,
             padding_type: int = 1, **extra: Any) -> list[Any]:
        return [Conv2d(cin, cout, k, bias=False, stride=stride, padding=padding,
                       padding_type=padding_type, gain_weight=gw, **extra),
                MixtureReLU(), BatchNorm2d(cout)]

    def block(cin: int, cout: int, stride: int) -> Any:
        pt = 2 if stride == 2 else 1
        main = LayerBlock(*conv(cin, cout, stride=stride, padding_type=pt), *conv(cout, cout))
        if stride == 1 and cin == cout:
            return ResNetBlock(main)
        return ResNetBlock(main, LayerBlock(*conv(cin, cout, k=2, stride=2, padding=0)))

    base = options.width
    if min(h, w) >= IMAGENET_STEM_FROM:
        layers: list[Any] = [*conv(c, base, k=6, stride=2, padding=2, in_width=w, in_height=h),
                             AvgPool2d(3, stride=2, padding=1, padding_type=2)]
        final_hw = h // 32
    else:
        layers = conv(c, base, in_width=w, in_height=h)
        final_hw = h // 8
    cin = base
    for stage, mult in enumerate((1, 2, 4, 8)):
        cout = base * mult
        stride = 1 if stage == 0 else 2
        layers += [block(cin, cout, stride), block(cout, cout, 1)]
        cin = cout
    return Sequential(*layers, AvgPool2d(final_hw),
                      Linear(cin, num_outputs, gain_weight=gw, gain_bias=gb),
                      dtype=options.dtype)



class BasicBlock(nn.Module):
    """The ResNet18 block: two 3x3 conv + BatchNorm, ReLU after the first and after the sum;
    a 1x1 strided conv + BatchNorm shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.main(x) + self.short(x))


class Bottleneck(nn.Module):
    """The ResNet50 block: 1x1 (to `mid`), 3x3 (strided), 1x1 (to 4·mid) conv + BatchNorm, ReLU
    between and after the sum; a 1x1 strided conv + BatchNorm shortcut where the shape
    changes."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.main = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid),
            nn.ReLU(), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.main(x) + self.short(x))


def _torch_stem(c: int, h: int, w: int, base: int) -> list[nn.Module]:
    """ImageNet's stem (7x7 stride-2 conv, 3x3 stride-2 max-pool) from `IMAGENET_STEM_FROM`
    pixels up, CIFAR's (3x3 conv, no pool) below; BatchNorm and ReLU after the conv."""
    if min(h, w) >= IMAGENET_STEM_FROM:
        return [Reshape((c, h, w)), nn.Conv2d(c, base, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(base), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
    return [Reshape((c, h, w)), nn.Conv2d(c, base, 3, padding=1, bias=False),
            nn.BatchNorm2d(base), nn.ReLU()]


def torch_resnet18(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """The usual ResNet18: the stem (`_torch_stem`: CIFAR's on small images, ImageNet's on
    large ones), stages of width 1, 2, 4, 8 x `width` with strides 1, 2, 2, 2, two blocks each,
    global average pool, linear head."""
    c, h, w = image(input_shape)
    base = options.width
    layers = _torch_stem(c, h, w, base)
    cin = base
    for stage, mult in enumerate((1, 2, 4, 8)):
        cout = base * mult
        layers += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_outputs)]
    return nn.Sequential(*layers)


def torch_resnet50(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions):
    """The usual ResNet50: the stem as torch-resnet18's, bottleneck stages of 3, 4, 6, 3 blocks
    (widths 1, 2, 4, 8 x `width`, out 4x that), strides 1, 2, 2, 2, global average pool,
    linear head (25.6 M parameters on ImageNet)."""
    c, h, w = image(input_shape)
    base = options.width
    layers = _torch_stem(c, h, w, base)
    cin = base
    for stage, (mult, blocks) in enumerate(zip((1, 2, 4, 8), (3, 4, 6, 3))):
        mid = base * mult
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, 2 if stage and not i else 1))
            cin = 4 * mid
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_outputs)]
    return nn.Sequential(*layers)



def check_input(spec: ModelSpec, input_shape: tuple[int, ...]) -> None:
    _, h, w = image_input(spec.name, input_shape)
    step = 32 if min(h, w) >= IMAGENET_STEM_FROM else 8
    if min(h, w) < 8 or h % step or w % step:
        after = " after a 4x smaller stem" if step == 32 else ""
        raise ConfigError(f"model {spec.name} needs images of a multiple of {step} pixels on "
                          f"each side (three stride-2 stages{after}); the dataset's are "
                          f"{h}x{w}")


_RESNET_DEFAULTS = {"batch_size": 64, "sigma_v": 0.05, "gain": 0.083}
FAMILY = Family(
    name="resnet",
    models=(ModelSpec("tagi-resnet18", "tagi", tagi_resnet18, "TAGI ResNet18 (pytagi's "
                      "CIFAR-10 one)", defaults=_RESNET_DEFAULTS),
            ModelSpec("torch-resnet18", "torch", torch_resnet18, "torch ResNet18 (CIFAR or "
                      "ImageNet stem by image size)"),
            ModelSpec("torch-resnet50", "torch", torch_resnet50, "torch ResNet50 (CIFAR or "
                      "ImageNet stem by image size)")),
    data=frozenset({"images"}), options=("width", "gain_weight", "gain_bias"),
    check_input=check_input)
