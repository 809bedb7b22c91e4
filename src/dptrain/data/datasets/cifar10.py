"""CIFAR-10 from the python pickle batches or the binary batches: 50000 / 10000, 32x32x3.

Python version (`cifar-10-batches-py/`): `data_batch_1..5` and `test_batch`, each a pickled dict
with `data` (N, 3072) uint8 (1024 red, 1024 green, 1024 blue, rows first) and `labels`.
Binary version (`cifar-10-batches-bin/`): `data_batch_1..5.bin` and `test_batch.bin`, records
of 1 label byte then the same 3072 pixel bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dptrain.data.datasets._files import existing_dir, find_file, read_bytes
from dptrain.data.datasets._safe_pickle import safe_loads
from dptrain.data.datasets.base import (
    Normalisation,
    Split,
    check_labels,
)
from dptrain.data.datasets.images import fit_image_normalisation, image_classification_split
from dptrain.errors import ConfigError, DataError

NUM_CLASSES = 10
PIXELS = 3 * 32 * 32
RECORD = 1 + PIXELS
NUM_TRAIN_BATCHES = 5
FORMATS = ("auto", "python", "binary")
_SUBDIRS = {"python": "cifar-10-batches-py", "binary": "cifar-10-batches-bin"}
_SUFFIX = {"python": "", "binary": ".bin"}


def read_cifar_binary(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) of one binary batch file."""
    data = read_bytes(path)
    if len(data) == 0 or len(data) % RECORD:
        raise DataError(f"{path}: size {len(data)} bytes is not a positive multiple of {RECORD} "
                        f"(1 label byte + {PIXELS} pixel bytes per record); the file is "
                        "truncated or not a CIFAR-10 binary batch")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD)
    labels = records[:, 0]
    check_labels(labels, NUM_CLASSES, where=str(path))
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def read_cifar_pickle(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) of one python batch file.

    Loaded with a restricted unpickler: a file that names any global other than numpy's array
    machinery is refused instead of executed.
    """
    try:
        batch = safe_loads(read_bytes(path))
    except DataError:
        raise
    except Exception as err:  # a corrupt pickle can raise nearly anything; all mean "bad file"
        raise DataError(f"{path}: not a readable CIFAR-10 python batch: "
                        f"{type(err).__name__}: {err}") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    data, labels = _entry(batch, "data", path), _entry(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != PIXELS:
        got = (f"{data.dtype} array {data.shape}" if isinstance(data, np.ndarray)
               else type(data).__name__)
        raise DataError(f"{path}: 'data' must be a uint8 array of shape (N, {PIXELS}), got {got}")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise DataError(f"{path}: 'labels' must be a list of ints: {err}") from None
    if labels.shape != (len(data),):
        raise DataError(f"{path}: {labels.size} labels but {len(data)} images")
    check_labels(labels, NUM_CLASSES, where=str(path))
    return data.reshape(-1, 3, 32, 32), labels


def _entry(batch: dict, key: str, path: str | Path) -> object:
    # Python 2 pickles (the official files) have bytes keys; re-pickled copies have str keys.
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise DataError(f"{path}: no {key!r} entry; keys are {sorted(map(str, batch))}")


def _detect_format(directory: Path) -> tuple[str, list[Path]]:
    for fmt in ("binary", "python"):
        name = "data_batch_1" + _SUFFIX[fmt]
        for d in (directory, directory / _SUBDIRS[fmt]):
            if (d / name).is_file():
                return fmt, [d]
    raise DataError(f"{directory}: no CIFAR-10 batches found; looked for data_batch_1.bin "
                    f"(binary) or data_batch_1 (python) in it and in its "
                    f"{'/ and '.join(_SUBDIRS.values())}/ subdirectory")


def _read_part(dirs: list[Path], fmt: str, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    read = read_cifar_binary if fmt == "binary" else read_cifar_pickle
    parts = [read(find_file(dirs, [n + _SUFFIX[fmt]], what=f"CIFAR-10 {fmt} batch"))
             for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_cifar10(directory: str | Path, *, format: str = "auto", flat: bool = False) -> Split:
    """CIFAR-10 from `directory` (or its `cifar-10-batches-py|bin` subdirectory).

    `format="auto"` picks the binary batches when both are present (no unpickling at all).
    Pixels stay uint8 in memory; batches come out normalised per channel with the
    training part's mean and std (`ImageDataset`), shaped
    (3, 32, 32), or (3072,) when `flat` (channel-major, as in the files).
    """
    if format not in FORMATS:
        raise ConfigError(f"load_cifar10 format must be one of {FORMATS}, got {format!r}")
    directory = existing_dir(directory, what="CIFAR-10")
    if format == "auto":
        format, dirs = _detect_format(directory)
    else:
        dirs = [directory, directory / _SUBDIRS[format]]
    train_names = [f"data_batch_{i}" for i in range(1, NUM_TRAIN_BATCHES + 1)]
    x_tr, y_tr = _read_part(dirs, format, train_names)
    x_te, y_te = _read_part(dirs, format, ["test_batch"])
    x_tr = torch.from_numpy(np.require(x_tr, requirements=("C", "W")))  # uint8: 150 MB, not 600 as float32
    x_te = torch.from_numpy(np.require(x_te, requirements=("C", "W")))
    x_norm = fit_image_normalisation(x_tr, dim=(0, 2, 3))
    if flat:
        x_tr, x_te = x_tr.reshape(-1, PIXELS), x_te.reshape(-1, PIXELS)
        x_norm = Normalisation(x_norm.mean.expand(3, 32, 32).reshape(PIXELS),
                               x_norm.std.expand(3, 32, 32).reshape(PIXELS))
    return image_classification_split("cifar10", x_tr, torch.from_numpy(y_tr), x_te,
                                      torch.from_numpy(y_te), NUM_CLASSES, x_norm,
                                      augment_by_default=True)
