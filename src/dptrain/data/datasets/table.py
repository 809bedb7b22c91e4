"""Regression tables from CSV or NPZ files, with target columns chosen by name or index.

CSV: comma-separated numbers, optionally a header row of column names (detected when a cell of
the first row is not a number). NPZ (loaded with `allow_pickle=False`), one of three layouts:
  - `x_train`, `y_train`, `x_test`, `y_test`: a fixed split, used as it is;
  - `x`, `y`: features and targets, split here;
  - one 2-D array (or one named `data`), optionally with `columns` (its column names): a table
    whose target columns are chosen as for CSV, then split here.
A split made here is a seeded permutation: `round(test_fraction * N)` rows go to the test part.
Features and targets are standardised with training statistics only.
"""

from __future__ import annotations

import csv
import io
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from dptrain.data.datasets._files import read_bytes
from dptrain.data.datasets.base import Split, check_finite, regression_split
from dptrain.errors import ConfigError, DataError

Column = str | int
_SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_csv(path: str | Path, *, target: Column | Sequence[Column] = -1,
             test_fraction: float = 0.2, seed: int = 0, delimiter: str = ",") -> Split:
    """A regression split from a CSV table; `target` names or indexes the target column(s)
    (default: the last column); every other column is a feature.

    Raises:
        DataError: missing file, ragged rows, a cell that is not a number, NaN/inf, or a target
            column that does not exist (the message lists the columns).
    """
    names, table = read_csv(path, delimiter=delimiter)
    x, y = _select(table, names, target, path)
    return _split_table(Path(path).stem, x, y, test_fraction, seed)


def read_csv(path: str | Path, *, delimiter: str = ",") -> tuple[list[str] | None, np.ndarray]:
    """Column names (None without a header row) and the values as float64 (rows, columns)."""
    try:
        text = read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not a UTF-8 text file: {err}") from None
    rows = [(n, row) for n, row in enumerate(csv.reader(io.StringIO(text), delimiter=delimiter),
                                             start=1) if row and any(c.strip() for c in row)]
    if not rows:
        raise DataError(f"{path}: empty CSV file")
    names = None
    if not all(_is_number(c) for c in rows[0][1]):
        names = [c.strip() for c in rows[0][1]]
        rows = rows[1:]
    if not rows:
        raise DataError(f"{path}: CSV file has a header but no data rows")
    width = len(names) if names is not None else len(rows[0][1])
    values = np.empty((len(rows), width))
    for i, (line, row) in enumerate(rows):
        if len(row) != width:
            raise DataError(f"{path}: line {line} has {len(row)} columns, expected {width}")
        for j, cell in enumerate(row):
            if not cell.strip():
                raise DataError(f"{path}: line {line}, column {j + 1}: empty cell (missing "
                                "value)")
            if not _is_number(cell):
                raise DataError(f"{path}: line {line}, column {j + 1}: not a number: {cell!r}")
            values[i, j] = float(cell)
    bad = ~np.isfinite(values)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise DataError(f"{path}: line {rows[i][0]}, column {j + 1}: {values[i, j]} "
                        f"({int(bad.sum())} NaN/inf value(s) in the file)")
    return names, values


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def load_npz(path: str | Path, *, target: Column | Sequence[Column] = -1,
             test_fraction: float = 0.2, seed: int = 0) -> Split:
    """A regression split from an NPZ file in one of the layouts of this module's docstring.
    `target` applies to the table layout only."""
    arrays = _read_npz(path)
    name = Path(path).stem
    if set(_SPLIT_KEYS) <= arrays.keys():
        x_tr, y_tr, x_te, y_te = (_numeric(arrays[k], f"{path}[{k!r}]") for k in _SPLIT_KEYS)
        _check_pairs(path, x_tr, y_tr, "train")
        _check_pairs(path, x_te, y_te, "test")
        return regression_split(name, *(torch.from_numpy(a) for a in (x_tr, y_tr, x_te, y_te)))
    if {"x", "y"} <= arrays.keys():
        x, y = _numeric(arrays["x"], f"{path}['x']"), _numeric(arrays["y"], f"{path}['y']")
        _check_pairs(path, x, y, "")
        return _split_table(name, x, y, test_fraction, seed)
    tables = [k for k in arrays if k != "columns"]
    key = "data" if "data" in tables else (tables[0] if len(tables) == 1 else None)
    if key is None:
        raise DataError(f"{path}: cannot tell which array is the table; expected {_SPLIT_KEYS}, "
                        f"('x', 'y'), 'data' or a single array, got {sorted(arrays)}")
    table = _numeric(arrays[key], f"{path}[{key!r}]")
    if table.ndim != 2:
        raise DataError(f"{path}[{key!r}]: a table must be 2-D, got shape {table.shape}")
    names = [str(c) for c in arrays["columns"]] if "columns" in arrays else None
    if names is not None and len(names) != table.shape[1]:
        raise DataError(f"{path}: 'columns' has {len(names)} names for {table.shape[1]} columns")
    x, y = _select(table, names, target, path)
    return _split_table(name, x, y, test_fraction, seed)


def _read_npz(path: str | Path) -> dict[str, np.ndarray]:
    if not Path(path).is_file():
        raise DataError(f"{path}: file not found")
    try:
        # np.load leaks its own file handle when the zip is bad, so we own the file
        with open(path, "rb") as f:
            if f.read(2) != b"PK":  # anything else np.load would try as .npy or as a pickle
                raise DataError(f"{path}: not an NPZ file (no zip signature at byte 0)")
            f.seek(0)
            with np.load(f, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
    except DataError:
        raise
    except ValueError as err:  # object arrays need pickle, which could run code
        raise DataError(f"{path}: cannot load without pickle (object arrays?): {err}") from None
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise DataError(f"{path}: not a readable NPZ file: {err}") from None


def _numeric(array: np.ndarray, where: str) -> np.ndarray:
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise DataError(f"{where}: expected numbers, got dtype {array.dtype}")
    array = array.astype(np.float64)
    check_finite(array, where=where)
    return array


def _check_pairs(path: str | Path, x: np.ndarray, y: np.ndarray, part: str) -> None:
    if x.ndim != 2 or y.ndim not in (1, 2) or len(x) != len(y) or len(x) == 0:
        raise DataError(f"{path}: x{'_' + part if part else ''} must be (N, F) and "
                        f"y{'_' + part if part else ''} (N,) or (N, T) with N > 0, got "
                        f"{x.shape} and {y.shape}")


def _column_index(col: Column, names: list[str] | None, width: int, path: str | Path) -> int:
    # A string is a column name first; failing that, "3" or "-1" (from a command line) is an
    # index.
    if isinstance(col, str):
        if names is not None and col in names:
            return names.index(col)
        if not col.strip().lstrip("-").isdigit():
            if names is None:
                raise DataError(f"{path}: target column {col!r} given by name, but the file has "
                                f"no column names; use an index in [-{width}, {width})")
            raise DataError(f"{path}: no column named {col!r}; the columns are {names}")
    index = int(col)
    if not -width <= index < width:
        raise DataError(f"{path}: target column index {index} out of range for {width} columns"
                        + (f" {names}" if names else ""))
    return index % width


def _select(table: np.ndarray, names: list[str] | None, target: Column | Sequence[Column],
            path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Split a (rows, columns) table into features and the target column(s)."""
    cols = [target] if isinstance(target, (str, int)) else list(target)
    if not cols:
        raise ConfigError("target must name at least one column")
    width = table.shape[1]
    picked = [_column_index(c, names, width, path) for c in cols]
    if len(set(picked)) != len(picked):
        raise DataError(f"{path}: target columns {cols} name the same column twice")
    if len(picked) == width:
        raise DataError(f"{path}: every column is a target ({cols}); no feature column is left")
    features = [j for j in range(width) if j not in picked]
    return table[:, features], table[:, picked]


def _split_table(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float,
                 seed: int) -> Split:
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    num_test = max(1, round(test_fraction * len(x)))
    if len(x) - num_test < 2:
        raise DataError(f"{name}: {len(x)} rows are too few for a train/test split with "
                        f"test_fraction={test_fraction} (the training part needs >= 2 rows)")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).numpy()
    test, train = order[:num_test], order[num_test:]
    t = torch.from_numpy
    return regression_split(name, t(x[train]), t(y[train]), t(x[test]), t(y[test]))
