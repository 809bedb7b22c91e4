"""How big the validation and test parts are: `--val-size` and `--test-size`, a count or a
fraction.

    parse_size("0.1", option="val-size")    # 0.1: a fraction of the whole
    parse_size("500", option="val-size")    # 500: samples (or time steps, for a series)
    count_of(0.1, 1437)                     # 144
    series_ends(240, val_size=24, test_size="0.25", where="sine")   # (156, 180)

A count is an integer >= 1; a fraction lies strictly between 0 and 1 and is written with a
point ("0.1", "1.0" is not one); "auto" leaves the size to the dataset (its own part, or the
default below).
"""

from __future__ import annotations

import math

from dptrain.errors import ConfigError, DataError

Size = int | float | None
"""A parsed size: a count (int), a fraction (float) or None (auto)."""

DEFAULT_VAL_FRACTION = 0.1
"""The share of the training part held out for validation when a dataset has no validation
part of its own and `--val-size` is auto (docs/design.md, Validation chooses)."""
SERIES_TRAIN_FRACTION, SERIES_VAL_FRACTION = 0.7, 0.1
"""A series' default parts: its first 70 % of time steps train, the next 10 % validate, the
last 20 % test."""


def parse_size(text: str | int | float | None, *, option: str) -> Size:
    """A size as given on the command line, in TOML or by a library caller: "auto" (or None)
    -> None, an integer >= 1 -> that count, a number strictly between 0 and 1 -> that fraction.

    Raises:
        ConfigError: anything else, in one line naming `option` and the value.
    """
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    if isinstance(text, bool):
        raise _bad(option, text)
    if isinstance(text, str):
        cell = text.strip()
        try:
            value: int | float = int(cell) if cell.lstrip("+-").isdigit() else float(cell)
        except ValueError:
            raise _bad(option, text) from None
    else:
        value = text
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, float) and 0 < value < 1:
        return value
    raise _bad(option, text)


def _bad(option: str, text: object) -> ConfigError:
    return ConfigError(f"--{option}: expected a count (an integer >= 1), a fraction strictly "
                       f"between 0 and 1 (such as 0.1) or auto, got {text!r}")


def count_of(size: int | float, total: int) -> int:
    """How many of `total` a parsed (not None) size takes: a count as it is, a fraction of
    `total` rounded to the nearest, at least 1."""
    if isinstance(size, int):
        return size
    return max(1, round(size * total))


def series_ends(num_steps: int, *, val_size: str | int | float | None = None,
                test_size: str | int | float | None = None, where: str,
                train_fraction: float = SERIES_TRAIN_FRACTION,
                val_fraction: float = SERIES_VAL_FRACTION) -> tuple[int, int]:
    """(train_end, val_end) of a series of `num_steps` time steps: train [0, train_end),
    validation [train_end, val_end), test [val_end, num_steps). A size left auto keeps the
    default parts (`train_fraction` then `val_fraction` of the steps, the rest testing); a
    fraction is of the whole series, rounded down.

    Raises:
        ConfigError: a size that does not parse, or parts that leave no training step.
    """
    val, test = (parse_size(val_size, option="val-size"),
                 parse_size(test_size, option="test-size"))

    def floor(fraction: float) -> int:
        # rounded first: 0.7 + 0.1 is 0.7999..., which would lose a step to the floor
        return math.floor(round(fraction * num_steps, 6))

    default_val_end = floor(train_fraction + val_fraction)
    test_steps = num_steps - default_val_end if test is None else \
        test if isinstance(test, int) else floor(test)
    val_steps = default_val_end - floor(train_fraction) if val is None else \
        val if isinstance(val, int) else floor(val)
    for option, steps, given, parsed in (("test-size", test_steps, test_size, test),
                                         ("val-size", val_steps, val_size, val)):
        if parsed is not None and steps < 1:
            raise DataError(f"{where}: --{option} {given} is {steps} of its {num_steps} time "
                            f"steps; a part needs at least one")
    if test_steps + val_steps >= num_steps:
        raise DataError(f"{where}: --test-size {_shown(test_size, test_steps)} and --val-size "
                        f"{_shown(val_size, val_steps)} take {test_steps + val_steps} time "
                        f"steps, but the series has {num_steps}: nothing is left to train on")
    val_end = num_steps - test_steps
    return val_end - val_steps, val_end


def _shown(given: object, steps: int) -> str:
    return f"auto ({steps})" if given is None or given == "auto" else f"{given} ({steps})"
