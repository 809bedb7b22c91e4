"""Image folders for the input-pipeline benchmarks, generated from a seed (no download).

Each image is an RGB JPEG (quality 90) of one of scikit-learn's 8x8 digits, upscaled to about
half the image side, coloured and blended at a random place onto a smooth random colour field,
with Gaussian pixel noise: photo-like JPEGs (smooth areas, edges, noise; about 15-25 kB at
256 x 256) in torchvision's ImageFolder layout, one class folder per digit:

    ROOT/train/digit<k>/<n>.jpg
    ROOT/val/digit<k>/<n>.jpg
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image


def _image(rng: np.random.Generator, digit: np.ndarray, width: int, height: int) -> Image.Image:
    field = rng.uniform(0, 255, (4, 4, 3)).astype(np.uint8)
    background = np.asarray(Image.fromarray(field).resize((width, height),
                                                          Image.Resampling.BICUBIC),
                            dtype=np.float32)
    side = int(min(width, height) * rng.uniform(0.4, 0.7))
    ink = np.asarray(Image.fromarray((digit * (255 / 16)).astype(np.uint8)).resize(
        (side, side), Image.Resampling.BILINEAR), dtype=np.float32)[..., None] / 255.0
    colour = rng.uniform(0, 255, 3).astype(np.float32)
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    patch = background[top:top + side, left:left + side]
    background[top:top + side, left:left + side] = patch * (1 - ink) + colour * ink
    background += rng.normal(0, 6, background.shape).astype(np.float32)
    return Image.fromarray(background.clip(0, 255).astype(np.uint8))


def write_image_folder(root: Path, *, train: int, val: int, width: int = 256, height: int = 256,
                       seed: int = 0, grey: bool = False) -> Path:
    """`train` + `val` JPEGs under `root` (see the module docstring), a tenth of each part
    per class (at least 10 images each), RGB or (`grey`) 1-channel; returns `root`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    by_class = [np.flatnonzero(digits.target == k) for k in range(10)]
    rng = np.random.default_rng(seed)
    for part, count in (("train", train), ("val", val)):
        for n in range(count):  # classes in turn, so each has a tenth of the images
            i = int(rng.choice(by_class[n % 10]))
            folder = root / part / f"digit{digits.target[i]}"
            folder.mkdir(parents=True, exist_ok=True)
            image = _image(rng, digits.images[i], width, height)
            (image.convert("L") if grey else image).save(folder / f"{n:07d}.jpg", quality=90)
    return root


def link_image_folder(source: Path, root: Path, *, train: int, val: int) -> Path:
    """A folder of `train` + `val` images made of hard links to the JPEGs of `source` (a
    folder written by `write_image_folder`), reused round-robin with their class: a folder of
    100,000 images in seconds and no disk space. Every entry is a real image file to the
    scan and the decoder."""
    for part, count in (("train", train), ("val", val)):
        files = sorted((source / part).glob("*/*.jpg"))
        for n in range(count):
            src = files[n % len(files)]
            folder = root / part / src.parent.name
            folder.mkdir(parents=True, exist_ok=True)
            os.link(src, folder / f"{n:07d}.jpg")
    return root


def machine_record() -> dict:
    """The hardware, software and git state a result file records."""
    import platform
    import subprocess

    import torch
    import PIL

    from .machine import cpu_model

    info: dict = {"cpu_model": cpu_model(), "logical_cores": os.cpu_count(),
                  "usable_cores": len(os.sched_getaffinity(0))}
    try:
        info["memory_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        from PIL import features
        turbo = features.check_feature("libjpeg_turbo")
    except Exception:  # noqa: BLE001 - older Pillow
        turbo = None
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"],
                             cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        git = None
    return {"hardware": info, "git": git,
            "software": {"python": platform.python_version(), "torch": torch.__version__,
                         "numpy": np.__version__, "pillow": PIL.__version__,
                         "libjpeg_turbo": turbo}}
