"""scikit-learn's digits written as the files of two real formats, for the stability benchmark
and its tests: what a new user points `dptrain train` at.

    write_mnist_digits(DIR)    DIR/{train,t10k}-{images-idx3,labels-idx1}-ubyte: 28x28 grey
    write_cifar_digits(DIR)    DIR/cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin: 32x32
                               colour

Both keep the data set's own order: the first 1500 images train, the last 297 test. MNIST
format: each 8x8 image upscaled 3x (nearest) to 24x24 and centred in 28x28 with a 2-pixel black
border, 0-16 ink scaled to 0-255. CIFAR format: upscaled 4x to 32x32, the ink drawn in a colour
and the background in another, both drawn per image from a fixed generator, so the three
channels carry the digit differently from image to image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

NUM_TRAIN = 1500


def _digits() -> tuple[np.ndarray, np.ndarray]:
    digits = load_digits()
    return digits.images / 16.0, digits.target.astype(np.uint8)  # (1797, 8, 8) in [0, 1]


def _write_idx(path: Path, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = (0x0800 + array.ndim).to_bytes(4, "big")
    header += b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.tobytes())


def write_mnist_digits(directory: Path) -> Path:
    """MNIST IDX files of the digits (1500 train / 297 test, 28x28); returns `directory`."""
    images, labels = _digits()
    big = np.kron(images, np.ones((3, 3)))  # (N, 24, 24)
    pixels = np.pad(big, ((0, 0), (2, 2), (2, 2)))
    pixels = np.round(pixels * 255).astype(np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    for stem, part in (("train", slice(None, NUM_TRAIN)), ("t10k", slice(NUM_TRAIN, None))):
        _write_idx(directory / f"{stem}-images-idx3-ubyte", pixels[part])
        _write_idx(directory / f"{stem}-labels-idx1-ubyte", labels[part])
    return directory


def write_cifar_digits(directory: Path, seed: int = 0) -> Path:
    """CIFAR-10 binary batches of colour digits (1500 train in 5 batches / 297 test, 32x32);
    returns `directory`."""
    images, labels = _digits()
    rng = np.random.default_rng(seed)
    ink = rng.uniform(0.5, 1.0, (len(images), 3, 1, 1))
    paper = rng.uniform(0.0, 0.4, (len(images), 3, 1, 1))
    big = np.kron(images, np.ones((4, 4)))[:, None]  # (N, 1, 32, 32)
    pixels = np.round((paper + (ink - paper) * big) * 255).astype(np.uint8)  # (N, 3, 32, 32)
    records = np.concatenate([labels[:, None], pixels.reshape(len(images), -1)], axis=1)
    out = directory / "cifar-10-batches-bin"
    out.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(np.array_split(records[:NUM_TRAIN], 5), start=1):
        (out / f"data_batch_{k}.bin").write_bytes(part.tobytes())
    (out / "test_batch.bin").write_bytes(records[NUM_TRAIN:].tobytes())
    return directory
