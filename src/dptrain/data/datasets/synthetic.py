"""Small synthetic image sets written in the real file formats, for tests, `--tiny` examples and
benchmarks: MNIST IDX files and CIFAR-10 python batches that the real readers load unchanged.

    from dptrain.data.datasets.synthetic import write_synthetic_cifar10, write_synthetic_mnist

    write_synthetic_mnist("data/mnist-tiny", num_train=64, num_test=32)
    write_synthetic_cifar10("data/cifar-tiny", num_train=64, num_test=32)

The images are noise around a class-dependent pattern (a bright square whose position is the
label), so a model can learn something from them; labels cycle through the classes.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

NUM_CLASSES = 10


def synthetic_images(num: int, channels: int, size: int, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(images (num, channels, size, size) uint8, labels (num,) uint8)."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(num) % NUM_CLASSES).astype(np.uint8)
    rng.shuffle(labels)
    images = rng.integers(0, 96, size=(num, channels, size, size)).astype(np.int32)
    block = max(2, size // 5)
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 5)
        top = 1 + row * (size // 2 - 1)
        left = (col * (size - block)) // 4
        images[i, :, top:top + block, left:left + block] += 150
    return np.clip(images, 0, 255).astype(np.uint8), labels


def _write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_synthetic_mnist(directory: str | Path, *, num_train: int = 64, num_test: int = 32,
                          size: int = 28, seed: int = 0) -> Path:
    """`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-...` in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for part, num, offset in (("train", num_train, 0), ("t10k", num_test, 1)):
        images, labels = synthetic_images(num, 1, size, seed * 2 + offset)
        _write_idx(directory / f"{part}-images-idx3-ubyte", images[:, 0], 2051)
        _write_idx(directory / f"{part}-labels-idx1-ubyte", labels, 2049)
    return directory


def write_synthetic_cifar10(directory: str | Path, *, num_train: int = 64, num_test: int = 32,
                            seed: int = 0) -> Path:
    """`data_batch_1..5` and `test_batch` (python pickles, as the official archive has them) in
    `directory`; the training images are spread over the five batches."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    images, labels = synthetic_images(num_train, 3, 32, seed * 2)
    for k, part in enumerate(np.array_split(np.arange(num_train), 5), start=1):
        _write_batch(directory / f"data_batch_{k}", images[part], labels[part])
    images, labels = synthetic_images(num_test, 3, 32, seed * 2 + 1)
    _write_batch(directory / "test_batch", images, labels)
    return directory


def _write_batch(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    batch = {b"data": images.reshape(len(images), -1), b"labels": [int(v) for v in labels]}
    path.write_bytes(pickle.dumps(batch, protocol=2))


def write_synthetic_image_folder(directory: str | Path, *, num_train: int = 40,
                                 num_test: int = 20, size: int = 64, num_classes: int = 4,
                                 seed: int = 0) -> Path:
    """An image folder (`directory/train/class<k>/*.jpg`, `directory/val/...`) of RGB JPEGs,
    `size` pixels a side, the classes told apart by where their bright square sits."""
    from PIL import Image  # deferred like the callers of the other writers, which need none

    directory = Path(directory)
    for part, num, offset in (("train", num_train, 0), ("val", num_test, 1)):
        images, labels = synthetic_images(num, 3, size, seed * 2 + offset)
        for i, (image, label) in enumerate(zip(images, labels % num_classes)):
            folder = directory / part / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.transpose(1, 2, 0)).save(folder / f"{i:05d}.jpg", quality=90)
    return directory
