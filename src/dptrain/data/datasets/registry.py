"""`load_dataset(spec)`: one string names any dataset, for the command line.

Spellings (NAME or NAME:PATH; options are keyword arguments of the loader):
    digits                 8x8 digits as (64,) vectors            load_digits(flat=True)
    digits-image           8x8 digits as (1, 8, 8) images          load_digits(flat=False)
    diabetes               scikit-learn's diabetes regression      load_diabetes()
    toy1d                  y = x³ + ε, 20 train / 200 test points  load_toy1d(...)
    toy1d-hetero           y = sin 3x + ε, σ_ε = 0.1 + 0.5|x|      load_toy1d_hetero(...)
    blobs                  3 overlapping Gaussian classes in 5-D   load_blobs(...)
    mnist:DIR              MNIST IDX files in DIR                  load_mnist(DIR, ...)
    fashion-mnist:DIR      Fashion-MNIST IDX files in DIR          load_mnist(DIR, ...)
    cifar10:DIR            CIFAR-10 python or binary batches       load_cifar10(DIR, ...)
    sine                   pytagi's toy sine series, as windows    load_sine(lookback=...)
    seasonal               4 seasonal series with trend and noise  load_seasonal(lookback=...)
    hourly                 6 hourly series, daily+weekly, gaps     load_hourly(lookback=...)
    series:PATH            time series CSV, as windows             load_series(PATH, ...)
    csv:PATH               regression table                        load_csv(PATH, target=...)
    npz:PATH               regression arrays                       load_npz(PATH, ...)
    imagefolder:DIR        DIR/train/<class>/*.jpg, DIR/val/...    load_image_folder(DIR, ...)
    text:PATH              UTF-8 text or *.txt folder, char ids    load_text(PATH, ...)
    tokens:DIR             train.bin, val.bin of nanoGPT, llm.c   load_tokens(DIR, ...)
    PATH.csv | PATH.npz    the same, recognised by the suffix
    PATH.py:FUNCTION       your own: FUNCTION() returns a Split    load_user_dataset(spec)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.data.datasets.base import Split
from dptrain.data.datasets.blobs import load_blobs
from dptrain.data.datasets.cifar10 import load_cifar10
from dptrain.data.datasets.idx import load_mnist
from dptrain.data.datasets.image_folder import load_image_folder
from dptrain.data.datasets.series import load_series
from dptrain.data.datasets.sklearn_sets import load_diabetes, load_digits
from dptrain.data.datasets.synthetic_series import load_hourly, load_seasonal, load_sine
from dptrain.data.datasets.table import load_csv, load_npz
from dptrain.data.datasets.text import load_text
from dptrain.data.datasets.token_files import load_tokens
from dptrain.data.datasets.toy1d import load_toy1d, load_toy1d_hetero
from dptrain.data.datasets.user_data import load_user_dataset
from dptrain.errors import ConfigError
from dptrain.user_code import is_code_spec

# name -> loader; the names in PATH_DATASETS take the part after the colon as first argument
BUILTIN_DATASETS: dict[str, Callable[..., Split]] = {
    "digits": functools.partial(load_digits, flat=True),
    "digits-image": functools.partial(load_digits, flat=False),
    "diabetes": load_diabetes,
    "toy1d": load_toy1d,
    "toy1d-hetero": load_toy1d_hetero,
    "blobs": load_blobs,
    "sine": load_sine,
    "seasonal": load_seasonal,
    "hourly": load_hourly,
}
PATH_DATASETS: dict[str, Callable[..., Split]] = {
    "mnist": functools.partial(load_mnist, variant="mnist"),
    "fashion-mnist": functools.partial(load_mnist, variant="fashion-mnist"),
    "cifar10": load_cifar10,
    "csv": load_csv,
    "npz": load_npz,
    "series": load_series,
    "imagefolder": load_image_folder,
    "text": load_text,
    "tokens": load_tokens,
}
_SUFFIXES = {".csv": "csv", ".npz": "npz"}
SERIES_DATASETS = ("sine", "seasonal", "hourly", "series")
"""The names whose datasets are windows of time series (they take lookback and horizon)."""
TOKEN_DATASETS = ("text", "tokens")
"""The names whose datasets are windows of token ids (they take block_size and seed)."""


def accepted_names() -> list[str]:
    """Every spelling `load_dataset` accepts, for help texts and error messages."""
    return [*BUILTIN_DATASETS, *(f"{n}:PATH" for n in PATH_DATASETS), "PATH.csv", "PATH.npz",
            "PATH.py:FUNCTION"]


def load_dataset(spec: str | Path, **options: Any) -> Split:
    """Load the dataset `spec` names (see this module's docstring for the spellings).

    Raises:
        ConfigError: an unknown name, a missing or unexpected PATH, or an option the loader
            does not take (the message lists what is accepted).
        DataError: the files themselves are missing or bad.
    """
    spec = str(spec)
    if is_code_spec(spec):
        if options:
            raise ConfigError(f"dataset {spec}: your own dataset takes no option(s) "
                              f"{sorted(options)}")
        return load_user_dataset(spec)
    name, sep, path = spec.partition(":")
    if name in BUILTIN_DATASETS:
        if sep:
            raise ConfigError(f"dataset {name!r} is built in and takes no path, got {spec!r}")
        return _call(name, BUILTIN_DATASETS[name], (), options)
    if name in PATH_DATASETS:
        if not path:
            raise ConfigError(f"dataset {name!r} needs a path: {name}:PATH, got {spec!r}")
        # "mnist:~/data" is one shell word, so the shell never expanded its "~"
        return _call(name, PATH_DATASETS[name], (str(Path(path).expanduser()),), options)
    suffix = Path(spec).suffix.lower()
    if suffix in _SUFFIXES:
        return _call(_SUFFIXES[suffix], PATH_DATASETS[_SUFFIXES[suffix]], (spec,), options)
    raise ConfigError(f"unknown dataset {spec!r}; accepted: {', '.join(accepted_names())}")


def _call(name: str, loader: Callable[..., Split], args: tuple, options: dict[str, Any]) -> Split:
    params = inspect.signature(loader).parameters
    # options a partial already fixed (flat for digits, variant for mnist) are not the user's
    fixed = loader.keywords if isinstance(loader, functools.partial) else {}
    allowed = [p for p, v in params.items() if v.kind is v.KEYWORD_ONLY and p not in fixed]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"dataset {name!r} does not take option(s) {unknown}; it takes "
                          f"{allowed or 'none'}")
    return loader(*args, **options)
