"""Unpickling CIFAR-10's python batches without letting the file run code.

A pickle names callables that the loader calls, so `pickle.load` on a downloaded file can run
anything (`os.system`, ...). This unpickler resolves only the few numpy globals a pickled
uint8 array needs and refuses every other global.
"""

from __future__ import annotations

import codecs
import importlib
import io
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np


def _numpy_core(submodule: str) -> Any:
    # numpy 2 renamed numpy.core to numpy._core and warns when the old name is imported; files
    # pickled by numpy 1 (CIFAR-10's are from 2009) still name numpy.core.
    core = "numpy._core" if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else "numpy.core"
    return importlib.import_module(f"{core}.{submodule}")


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Protocol-2 pickles written by Python 3 store bytes as codecs.encode(text, "latin1").
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"codecs.encode with encoding {encoding!r} is not allowed")
    return codecs.encode(text, encoding)


_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: _latin1_encode,
}
for _core in ("numpy.core", "numpy._core"):
    _ALLOWED[(f"{_core}.multiarray", "_reconstruct")] = \
        lambda: _numpy_core("multiarray")._reconstruct
    _ALLOWED[(f"{_core}.multiarray", "scalar")] = lambda: _numpy_core("multiarray").scalar
    _ALLOWED[(f"{_core}.numeric", "_frombuffer")] = lambda: _numpy_core("numeric")._frombuffer


class RestrictedUnpickler(pickle.Unpickler):
    """Loads dicts, lists, str/bytes, numbers and numpy arrays; any other global raises
    `pickle.UnpicklingError` naming it."""

    def find_class(self, module: str, name: str) -> Any:
        resolve = _ALLOWED.get((module, name))
        if resolve is None:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}: only numpy "
                                         "arrays are allowed in a dataset pickle")
        return resolve()


def safe_loads(data: bytes) -> Any:
    """`pickle.loads` that refuses globals other than numpy arrays'; Python 2 strings load as
    bytes, as in CIFAR-10's files."""
    return RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()


class _BuiltinsOnlyUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, sets, str/bytes, numbers, booleans and None, which a pickle
    holds without naming any callable; every global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}: only plain "
                                     "dicts, lists, strings and numbers are allowed")


def safe_loads_plain(data: bytes) -> Any:
    """`pickle.loads` of plain Python data (nanoGPT's meta.pkl: a dict of its vocabulary),
    refusing every global, so the file cannot run code."""
    return _BuiltinsOnlyUnpickler(io.BytesIO(data)).load()
