"""`dptrain train`'s flags and TOML keys, generated from the fields of `TrainOptions`.

A field's docstring is its flag's help; its default's type the flag's type; a bool field is a
switch (`--average`, or `--no-progress` for one that defaults to on); an on/off field has a flag
for each (`--augment`, `--no-augment`). Values resolve as defaults < the model's tuned defaults
< a TOML file < flags given on the command line.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.learners.build import model_defaults
from dptrain.options import field_docs, flag, literal_choices
from dptrain.train.options import TrainOptions

FIRST_KEYS = ("model", "dataset", "nproc", "epochs", "batch_size", "seed")
"""Shown first in help texts and error messages: what a run is mostly told."""


def option_fields() -> list[Field]:
    """The fields of `TrainOptions`, the most used first."""
    by_name = {f.name: f for f in fields(TrainOptions)}
    return [by_name[n] for n in FIRST_KEYS] + [f for n, f in by_name.items()
                                               if n not in FIRST_KEYS]


def accepted_keys() -> list[str]:
    return [f.name for f in option_fields()]


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (two for an on/off one); each defaults to None, meaning "not given"."""
    docs = field_docs(TrainOptions)
    for f in option_fields():
        text = docs[f.name].replace("%", "%%")
        meta, default = f.metadata, f.default
        if isinstance(default, bool):
            if default:
                parser.add_argument(f"--{meta['negative']}", dest=f.name, action="store_false",
                                    default=None, help=f"turn off: {text}")
            else:
                parser.add_argument(f"--{flag(f.name)}", action="store_true", default=None,
                                    help=text)
            continue
        if meta.get("negative"):
            parser.add_argument(f"--{flag(f.name)}", action="store_const", const="on",
                                default=None, help=f"{text} (default {default})")
            parser.add_argument(f"--{meta['negative']}", dest=f.name, action="store_const",
                                const="off")
            continue
        shown = f" (default {default})" if default != "" and default is not MISSING else ""
        choices = literal_choices(TrainOptions, f.name) if meta.get("choices") else None
        parser.add_argument(f"--{flag(f.name)}", type=type(default), choices=choices,
                            metavar=meta.get("metavar"), help=text + shown)


def _coerce(name: str, value: Any) -> Any:
    """Check a TOML value's type against the field's default (TOML has real types)."""
    default = getattr(TrainOptions(), name)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value, ok = str(value), True  # precision = 32 written as a number
    if not ok:
        raise ConfigError(f"key {name!r}: expected a {type(default).__name__}, got {value!r}")
    return value


def read_toml(path: Path | str) -> dict[str, Any]:
    """The options a TOML file sets, hyphens or underscores; unknown keys are an error."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    raw = raw.get("train", raw)  # keys may sit at the top level or under [train]
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in accepted_keys():
            raise ConfigError(f"{path}: unknown key {key!r}; accepted: "
                              f"{', '.join(accepted_keys())}")
        out[name] = _coerce(name, value)
    return out


def resolve(flags: dict[str, Any], config_file: str | None) -> TrainOptions:
    """Defaults < the model's own defaults < TOML file < flags given on the command line (those
    not None)."""
    merged = read_toml(config_file) if config_file else {}
    merged.update({k: v for k, v in flags.items() if v is not None})
    merged = {**model_defaults(merged.get("model", TrainOptions.model)), **merged}
    return TrainOptions(**merged)
