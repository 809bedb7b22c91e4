"""The search space: one `Dimension` per `dptrain train` option that the search varies.

    dims = parse_space(["lr=log:1e-4:1e-1", "batch_size=choice:32,64"])
    dims["lr"].suggest(trial)          # a value drawn by the study's sampler (Optuna trial)

Written `KEY=KIND:ARGS` on the command line (`--space`) or `KEY = "KIND:ARGS"` under `[space]`
in the TOML file, both parsed here so they cannot disagree. KIND is `log:LOW:HIGH` (a float
drawn on a log scale), `float:LOW:HIGH`, `int:LOW:HIGH` (bounds included) or `choice:A,B,...`
(values of the option's own type). A key must be an option of `dptrain train`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from dptrain.errors import ConfigError
from dptrain.options import flag, value_type
from dptrain.train.options import TrainOptions

KINDS = ("log", "float", "int", "choice")
NOT_SEARCHED = frozenset({"out", "resume", "fail_at", "progress", "monitor"})
"""Options a trial's run needs set one way: its directory, resuming, the monitored metric."""


@dataclass(frozen=True)
class Dimension:
    """One searched option: `kind` with its bounds (`low`, `high`) or its `choices`."""

    name: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        """The value an Optuna `trial` draws (or was enqueued with) for this option."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high))
        return trial.suggest_float(self.name, self.low, self.high, log=self.kind == "log")

    def spec(self) -> str:
        """This dimension written as on the command line (stored with the study)."""
        if self.kind == "choice":
            return f"{self.name}=choice:{','.join(map(str, self.choices))}"
        low, high = (int(self.low), int(self.high)) if self.kind == "int" else (self.low,
                                                                               self.high)
        return f"{self.name}={self.kind}:{low}:{high}"


def _option_types() -> dict[str, type]:
    """Each option's type of values (int for one that may be unset, `int | None`)."""
    return {f.name: value_type(TrainOptions, f.name) for f in fields(TrainOptions)}


def _number(text: str, where: str, kind: type) -> float:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a {'integer' if kind is int else 'number'}"
                          ) from None


def parse_dimension(spec: str, where: str = "--space") -> Dimension:
    """`KEY=KIND:ARGS` -> Dimension; a bad key, kind or range is one line naming `where`."""
    key, sep, rest = spec.partition("=")
    name = key.strip().replace("-", "_")
    where = f"{where} {spec!r}"
    if not sep or not name:
        raise ConfigError(f"{where}: expected KEY=KIND:ARGS, e.g. lr=log:1e-4:1e-1")
    types = _option_types()
    if name not in types or name in NOT_SEARCHED:
        searchable = ", ".join(flag(n) for n in types if n not in NOT_SEARCHED)
        raise ConfigError(f"{where}: {key.strip()!r} is not an option of dptrain train that "
                          f"a search may vary; options: {searchable}")
    kind, _, args = rest.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    option_type = types[name]
    if kind == "choice":
        values = [v.strip() for v in args.split(",") if v.strip()]
        if not values:
            raise ConfigError(f"{where}: an empty choice; list the values: choice:A,B,...")
        return Dimension(name, kind, choices=tuple(_choice(v, option_type, where)
                                                   for v in values))
    if option_type not in (int, float):
        raise ConfigError(f"{where}: {flag(name)} takes a {option_type.__name__}: only "
                          f"choice:A,B,... can vary it")
    bounds = args.split(":")
    if len(bounds) != 2:
        raise ConfigError(f"{where}: expected {kind}:LOW:HIGH")
    number = int if kind == "int" else float
    low, high = (_number(b, where, number) for b in bounds)
    if option_type is int and kind != "int":
        raise ConfigError(f"{where}: {flag(name)} is an integer option: use int:LOW:HIGH")
    if not math.isfinite(low) or not math.isfinite(high) or low >= high:
        raise ConfigError(f"{where}: an empty or inverted range [{low}, {high}]; LOW must be "
                          f"below HIGH")
    if kind == "log" and low <= 0:
        raise ConfigError(f"{where}: a log range must lie above 0, got LOW {low}")
    return Dimension(name, kind, low=low, high=high)


def _choice(text: str, option_type: type, where: str) -> Any:
    if option_type is bool:
        if text.lower() not in ("true", "false"):
            raise ConfigError(f"{where}: {text!r} is not true or false")
        return text.lower() == "true"
    if option_type in (int, float):
        return _number(text, where, option_type)
    return text


def parse_space(specs: list[str] | tuple[str, ...], where: str = "--space"
                ) -> dict[str, Dimension]:
    """Every `KEY=KIND:ARGS`; a key given twice is an error."""
    dims: dict[str, Dimension] = {}
    for spec in specs:
        dim = parse_dimension(spec, where)
        if dim.name in dims:
            raise ConfigError(f"{where}: {flag(dim.name)} is searched twice")
        dims[dim.name] = dim
    return dims


def specs_from_toml(table: dict[str, Any], path: str) -> list[str]:
    """The `[space]` table of a TOML file as `KEY=KIND:ARGS` specs."""
    specs = []
    for key, value in table.items():
        if not isinstance(value, str):
            raise ConfigError(f"{path}: [space] {key} must be a string such as "
                              f"\"log:1e-4:1e-1\", got {value!r}")
        specs.append(f"{key}={value}")
    return specs


def grid(dims: dict[str, Dimension]) -> dict[str, list[Any]]:
    """The search space of the grid sampler: choice lists only."""
    ranged = [flag(d.name) for d in dims.values() if d.kind != "choice"]
    if ranged:
        raise ConfigError(f"--sampler grid takes choice:A,B,... dimensions only; "
                          f"{', '.join(ranged)} is a range")
    return {d.name: list(d.choices) for d in dims.values()}
