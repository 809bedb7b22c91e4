"""MNIST and Fashion-MNIST from their IDX files (raw or gzip).

IDX layout: a 4-byte big-endian magic (two zero bytes, a type code, the number of dims), one
4-byte big-endian size per dim, then the values in C order. MNIST labels have magic 2049
(0x801: unsigned bytes, 1 dim), images 2051 (0x803: unsigned bytes, 3 dims).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from dptrain.data.datasets._files import existing_dir, find_file, read_bytes
from dptrain.data.datasets.base import Split, check_labels
from dptrain.data.datasets.images import fit_image_normalisation, image_classification_split
from dptrain.errors import ConfigError, DataError

IDX_LABELS = 2049
IDX_IMAGES = 2051
_IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_KIND = {IDX_LABELS: "labels", IDX_IMAGES: "images"}
VARIANTS = ("mnist", "fashion-mnist")


def read_idx(path: str | Path, *, magic: int | None = None) -> np.ndarray:
    """The array stored in an IDX file (read-only view of the file's bytes).

    Raises:
        DataError: missing file, wrong magic (when `magic` is given), unknown type code, or a
            size that disagrees with the header (truncated file or trailing bytes).
    """
    data = read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: truncated IDX file: {len(data)} bytes, the header needs 4")
    got = int.from_bytes(data[:4], "big")
    if magic is not None and got != magic:
        raise DataError(f"{path}: wrong magic number {got} (0x{got:08x}) at byte 0, expected "
                        f"{magic} (0x{magic:08x}, IDX {_KIND.get(magic, 'file')})")
    code, ndim = data[2], data[3]
    if data[:2] != b"\0\0" or code not in _IDX_DTYPES or ndim == 0:
        raise DataError(f"{path}: not an IDX file: magic 0x{got:08x} has no known type code "
                        f"and dimension count")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX file: {len(data)} bytes, the header of a "
                        f"{ndim}-dim array needs {header}")
    dims = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = header + math.prod(dims) * dtype.itemsize
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "trailing bytes after the data"
        raise DataError(f"{path}: {problem}: the header says shape {dims}, i.e. {expected} "
                        f"bytes, but the (decompressed) file has {len(data)}")
    return np.frombuffer(data, dtype=dtype, count=math.prod(dims), offset=header).reshape(dims)


def _idx_names(stem: str, kind: str) -> list[str]:
    # The original site uses "train-images-idx3-ubyte"; some mirrors "train-images.idx3-ubyte".
    return [name + suffix for name in (f"{stem}-{kind}", f"{stem}.{kind}")
            for suffix in ("", ".gz")]


def read_mnist_part(directory: str | Path, part: str, *,
                    num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) uint8 of `part` ("train" or "t10k")."""
    directory = existing_dir(directory, what="MNIST")
    dirs = [directory, directory / "raw"]  # "raw" is torchvision's layout
    images_path = find_file(dirs, _idx_names(f"{part}-images", "idx3-ubyte"),
                            what=f"MNIST {part} images in {directory}")
    labels_path = find_file(dirs, _idx_names(f"{part}-labels", "idx1-ubyte"),
                            what=f"MNIST {part} labels in {directory}")
    images = read_idx(images_path, magic=IDX_IMAGES)
    labels = read_idx(labels_path, magic=IDX_LABELS)
    if len(labels) != len(images):
        raise DataError(f"{labels_path}: {len(labels)} labels but {images_path} holds "
                        f"{len(images)} images")
    check_labels(labels, num_classes, where=str(labels_path))
    return images, labels


def load_mnist(directory: str | Path, *, flat: bool = False, variant: str = "mnist") -> Split:
    """MNIST or Fashion-MNIST (same file names and format) from `directory`: 60000 / 10000.

    Looks for `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
    `t10k-labels-idx1-ubyte`, each raw or `.gz`, in `directory` or `directory/raw`. Pixels stay
    uint8 in memory; batches come out normalised with the mean and std of all training pixels (one scalar each: per-pixel std is
    zero at the borders), shaped (1, 28, 28), or (784,) when `flat`.
    """
    if variant not in VARIANTS:
        raise ConfigError(f"load_mnist variant must be one of {VARIANTS}, got {variant!r}")
    x_tr, y_tr = read_mnist_part(directory, "train")
    x_te, y_te = read_mnist_part(directory, "t10k")
    shape = (-1, x_tr.shape[1] * x_tr.shape[2]) if flat else (-1, 1, *x_tr.shape[1:])
    if x_tr.dtype != np.uint8 or x_te.dtype != np.uint8:
        raise DataError(f"{directory}: MNIST images must be unsigned bytes (IDX type 0x08), "
                        f"got {x_tr.dtype} and {x_te.dtype}")
    x_tr = torch.from_numpy(np.require(x_tr, requirements=("C", "W"))).reshape(shape)  # uint8 in memory
    x_te = torch.from_numpy(np.require(x_te, requirements=("C", "W"))).reshape(shape)
    x_norm = fit_image_normalisation(x_tr, dim=tuple(range(x_tr.ndim)))
    return image_classification_split(variant, x_tr, torch.from_numpy(y_tr.astype(np.int64)),
                                      x_te, torch.from_numpy(y_te.astype(np.int64)), 10, x_norm)
