"""A user's Python file named on the command line as `PATH.py:FUNCTION` (`--model`, `--dataset`).

    fn = load_function("my_data.py:folders", option="--dataset")   # imports the file
    file_sha256("my_data.py:folders")                               # what the run records

The file is imported under a name derived from its path and registered in `sys.modules`, so
pickling (DataLoader workers, dataclasses) finds what it defines. A process that starts afresh
(a DataLoader worker) imports the same files again first: pickle `ImportedFirst()` before the
objects they define.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError


def is_code_spec(spec: str) -> bool:
    """True for `PATH.py:FUNCTION` (as opposed to a built-in name)."""
    path, sep, func = spec.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(func)


def file_sha256(spec: str | Path) -> str | None:
    """Hex SHA-256 of a user file's bytes, what identifies it in a run's record: `spec` is the
    file's path or a `PATH.py:FUNCTION` spelling; None for anything else (a built-in name)."""
    if is_code_spec(str(spec)):
        path: str | Path = str(spec).rpartition(":")[0]
    elif isinstance(spec, Path) or str(spec).endswith(".py"):
        path = spec
    else:
        return None
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError as err:
        raise ConfigError(f"file {path}: cannot read it: {err.strerror or err}") from None


def split_spec(spec: str, option: str) -> tuple[Path, str]:
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not func.isidentifier():
        raise ConfigError(f"{option} {spec!r}: expected PATH.py:FUNCTION (a Python file and the "
                          f"name of a function in it)")
    return Path(path).expanduser(), func


def load_function(spec: str, *, option: str, what: str) -> Callable[..., Any]:
    """The function `spec` names, imported from its file (which runs the file's top level);
    `option` and `what` ("model file") name it in errors."""
    path, func = split_spec(spec, option)
    if not path.is_file():
        raise ConfigError(f"{option} {spec}: {what} not found: {path}")
    name = f"{MODULE_PREFIX}{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
    try:
        module = _import(name, path)
    except ImportError as err:
        raise ConfigError(f"{option} {spec}: {err}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and getattr(v, "__module__", None) == name)
        raise ConfigError(f"{option} {spec}: {path} has no function {func!r} (it defines: "
                          f"{', '.join(defined) or 'no functions'})")
    return fn


MODULE_PREFIX = "_dptrain_user_code_"
"""The start of the module name a user's file is imported under."""


def _import(name: str, path: Path) -> Any:
    """Import the file `path` as the module `name` (registered in `sys.modules`); ImportError
    saying why not."""
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's code: any failure is "this file does not import"
        del sys.modules[name]
        raise ImportError(f"importing {path} failed: {type(err).__name__}: {err}") from None
    return module


class ImportedFirst:
    """The user files this process imported, named in a pickle so that the process reading it
    imports them again, under the same names, before it meets what they define (pickle
    rebuilds objects in the order it wrote them: pickle this one first)."""

    def __init__(self) -> None:
        self.files = {name: module.__file__ for name, module in list(sys.modules.items())
                      if name.startswith(MODULE_PREFIX) and getattr(module, "__file__", None)}

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _import_missing, (self.files,)


def _import_missing(files: dict[str, str]) -> dict[str, str]:
    for name, path in files.items():
        if name not in sys.modules:
            _import(name, Path(path))
    return files
