"""Options declared once, on the dataclass field that holds them.

Each component's config (`ModelConfig`, `LearnerConfig`, `DataConfig`, `FitOptions`,
`LaunchConfig`) is a frozen kw-only dataclass whose fields carry a docstring underneath, as
attribute docs do. From the field alone the command line takes its flag, type and help text,
a TOML file its key, and a checkpoint its run record: a field is part of what defines a run
unless it is declared `resumable()`.

    @dataclass(frozen=True, kw_only=True)
    class FitOptions:
        epochs: int = field(default=10, metadata=resumable())
        \"\"\"Epochs to train.\"\"\"

    field_docs(FitOptions)["epochs"]      # "Epochs to train."
    defines_run(fields(FitOptions)[0])    # False
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any

from dptrain.errors import ConfigError


def resumable(**cli: Any) -> dict[str, Any]:
    """Field metadata of an option that may change when a run resumes (how long, how it is
    launched or logged), as opposed to one that defines what the run computes."""
    return {"resumable": True, **cli}


def cli(*, metavar: str | None = None, choices: bool = False, negative: str | None = None
        ) -> dict[str, Any]:
    """Field metadata for the command line: `metavar`, argparse `choices` from the field's
    Literal type, or for a bool (or on/off string) field the spelling of its negative flag."""
    return {"metavar": metavar, "choices": choices, "negative": negative}


def defines_run(f: dataclasses.Field) -> bool:
    return not f.metadata.get("resumable", False)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` and its dataclass bases, by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def literal_choices(cls: type, name: str) -> tuple[Any, ...] | None:
    """The values of a `Literal[...]` field annotation, else None."""
    hint = typing.get_type_hints(cls)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def value_type(cls: type, name: str) -> type:
    """The type of the values option `name` of dataclass `cls` takes on the command line and in
    a TOML file: its annotation's, without the None of an option that may be unset
    (`int | None` -> int), str for a `Literal` of strings."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is typing.Literal:
        return type(typing.get_args(hint)[0])
    given = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(given) == 1:
        return given[0]
    return hint


def pick(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of dataclass `cls` from the entries of `values` that are its fields (a
    wider options object's fields, or a saved record)."""
    if dataclasses.is_dataclass(values):
        values = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def flag(name: str) -> str:
    """How an option is spelled on the command line and in messages: batch_size -> batch-size."""
    return name.replace("_", "-")


def bad_value(obj: Any, name: str, allowed: str) -> ConfigError:
    """The one-line error for option `name` of `obj` outside what is `allowed`."""
    return ConfigError(f"{flag(name)}: expected {allowed}, got {getattr(obj, name)!r}")


def check_at_least(obj: Any, names: tuple[str, ...], low: int) -> None:
    """Each integer option in `names` is >= `low`."""
    for name in names:
        if getattr(obj, name) < low:
            raise bad_value(obj, name, f"an integer >= {low}")


def check_unset_or_at_least(obj: Any, names: tuple[str, ...], low: int) -> None:
    """Each integer option in `names` is None (unset) or >= `low`; the message names 0, which
    its owner reads as unset (as the command line and TOML files give it)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            raise bad_value(obj, name, f"an integer >= {low}, or 0 to leave it unset")
