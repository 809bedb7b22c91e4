"""Image folders made from real data for the tests: scikit-learn's digits, upscaled, written as
PNG and JPEG files in torchvision's ImageFolder layout (DIR/train/<class>/, DIR/val/<class>/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def write_digits_folder(root: Path, *, scale: int = 3, per_class: int | None = None,
                        colour: bool = False) -> Path:
    """The digits split as `load_digits` splits it (1437 train / 360 val; `per_class` keeps the
    first n of each class in each part), 8x8 upscaled `scale` times; even samples PNG, odd JPEG
    (quality 95). Returns `root`."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.images, digits.target, test_size=360,
                                              stratify=digits.target, random_state=0)
    for part, images, labels in (("train", x_tr, y_tr), ("val", x_te, y_te)):
        kept: dict[int, int] = {}
        for i, (image, label) in enumerate(zip(images, labels)):
            if per_class is not None and kept.get(int(label), 0) >= per_class:
                continue
            kept[int(label)] = kept.get(int(label), 0) + 1
            folder = root / part / f"digit{label}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = Image.fromarray((image * (255 / 16)).round().astype(np.uint8), mode="L")
            pixels = pixels.resize((8 * scale, 8 * scale), Image.Resampling.NEAREST)
            if colour:
                pixels = pixels.convert("RGB")
            if i % 2 == 0:
                pixels.save(folder / f"{i:05d}.png")
            else:
                pixels.save(folder / f"{i:05d}.jpg", quality=95)
    return root
