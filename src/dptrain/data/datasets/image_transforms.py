"""Image transforms with ImageNet's conventions, on Pillow images, drawn from (seed, epoch, index).

Training: a random resized crop (area 8-100 % of the image, aspect ratio 3/4-4/3, log-uniform,
ten tries then the centre crop, as torchvision's `RandomResizedCrop` samples it) resized to
S x S, and a horizontal flip with probability 1/2. Evaluation: the shorter side resized to
S / 0.875 (256 for 224), then the centre S x S crop. Resizing is Pillow's bilinear filter,
which widens its support when shrinking (antialiased), as torchvision's does.

Decoding and resizing are Pillow's (libjpeg-turbo, libpng, libwebp underneath): the same
decoder torchvision's `ImageFolder` uses by default. torchvision's own image ops are not used:
its wheels on PyPI are built against CUDA builds of torch and do not load with a CPU torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from dptrain.data.datasets.images import draw_keys

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
CROP_FRACTION = 0.875
"""Evaluation resizes the shorter side to size / CROP_FRACTION before the centre crop."""


def random_crop_box(width: int, height: int, rng: np.random.Generator
                    ) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a random resized crop: `SCALE` of the area, `RATIO` aspect."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    ratio = width / height  # fall back to the centre crop of the closest allowed aspect
    if ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


@dataclass(frozen=True)
class ImageTransform:
    """The transform of one part of a dataset: `train` (random, seeded) or evaluation."""

    size: int
    train: bool = False
    seed: int = 0

    def __call__(self, image: Image.Image, index: int, epoch: int) -> Image.Image:
        if not self.train:
            return self.evaluation(image)
        rng = np.random.default_rng(int(draw_keys(self.seed, epoch, np.array([index]))[0]))
        left, top, w, h = random_crop_box(*image.size, rng)
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR,
                             box=(left, top, left + w, top + h))
        if rng.integers(0, 2):
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return image

    def evaluation(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        short = int(self.size / CROP_FRACTION)
        scale = short / min(width, height)
        new_w, new_h = max(short, round(width * scale)), max(short, round(height * scale))
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
        left, top = (new_w - self.size) // 2, (new_h - self.size) // 2
        return image.crop((left, top, left + self.size, top + self.size))
