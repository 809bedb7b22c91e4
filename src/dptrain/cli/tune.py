"""`dptrain tune`: a hyperparameter search whose trials are `dptrain train` runs. Only parses:
the search is `dptrain.tune`.

Its flags: every `dptrain train` option (the runs' base options; --out is the study directory)
and the fields of `TuneOptions`. A TOML file (--config) holds train keys at its top level (or
under [train]), the searched options under [space] (`lr = "log:1e-4:1e-1"`) and the search's
own options under [tune]; flags win.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from dptrain.cli.train import accepted_keys, add_option_flags, table_options
from dptrain.errors import ConfigError
from dptrain.options import field_docs, flag, literal_choices

SHARED = ("out", "monitor")
"""Options of both: --out is the study directory, --monitor the runs' (and the objective's)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from dptrain.tune.options import TuneOptions

    p = subparsers.add_parser(
        "tune", help="search hyperparameters: each trial one dptrain train run (Optuna)",
        description="Search dptrain train's options on Optuna: each trial is one data-parallel "
                    "run in OUT/trial-NNNN/, pruned from its epochs.csv; several workers (the "
                    "same command on several nodes) share the study. Needs dptrain[tune].")
    p.add_argument("--config", metavar="FILE.toml",
                   help="train keys, a [space] table and a [tune] table; flags win")
    add_option_flags(p)
    docs = field_docs(TuneOptions)
    for f in fields(TuneOptions):
        if f.name in SHARED:
            continue
        text = docs[f.name].replace("%", "%%")
        if f.name == "space":
            p.add_argument("--space", action="append", default=None,
                           metavar=f.metadata.get("metavar"), help=text)
        elif isinstance(f.default, bool):
            p.add_argument(f"--{flag(f.name)}", action="store_true", default=None, help=text)
        else:
            choices = literal_choices(TuneOptions, f.name) if f.metadata.get("choices") else None
            p.add_argument(f"--{flag(f.name)}", type=type(f.default), default=None,
                           choices=choices, metavar=f.metadata.get("metavar"),
                           help=f"{text} (default {f.default})" if f.default not in ("", MISSING)
                           else text)
    p.set_defaults(func=tune_command)


def read_config(path: str | None) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """(train keys, [space] specs, [tune] keys) of a TOML file."""
    from dptrain.tune.options import TuneOptions
    from dptrain.tune.space import specs_from_toml

    if not path:
        return {}, [], {}
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    space = specs_from_toml(raw.pop("space", {}), path)
    tune_keys = {k.replace("-", "_"): v for k, v in raw.pop("tune", {}).items()}
    known = {f.name for f in fields(TuneOptions)} - {"space"}
    unknown = sorted(set(tune_keys) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} in [tune]; accepted: "
                          f"{', '.join(sorted(known))}")
    return table_options(raw.get("train", raw), Path(path)), space, tune_keys


def options_from_args(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Pure: (TuneOptions, the runs' base options: the train keys given, flags winning)."""
    from dptrain.tune.options import TuneOptions

    base, space, tune_keys = read_config(args.config)
    base.update({n: getattr(args, n) for n in accepted_keys() if getattr(args, n) is not None})
    names = [f.name for f in fields(TuneOptions) if f.name not in SHARED + ("space",)]
    tune_keys.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    tune_keys["space"] = tuple(space + (args.space or []))
    for name in SHARED:
        if name in base:
            tune_keys[name] = base.pop(name)
    return TuneOptions(**tune_keys), base


def tune_command(args: argparse.Namespace) -> int:
    from dptrain.tune.study import import_optuna

    import_optuna()  # without the extra: the one line that says how to install it
    options, base = options_from_args(args)
    from dptrain.tune import tune

    tune(options, base)
    return 0
