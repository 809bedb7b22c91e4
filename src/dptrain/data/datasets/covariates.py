"""Known covariates of time series: calendar features of the time column and known columns of
the CSV, one row per time step shared by every series.

    from dptrain.data.datasets.covariates import time_features, with_covariates

    features, names = time_features(series.times, "hour,weekday")   # (T, 9), their names
    split = with_covariates(split, features, names)   # windows of (value, covariates) pairs

A covariate is known ahead (a calendar, a planned price, a holiday), never predicted: a
window's input step k holds the value at t − L + k and the covariates of time t − L + k + H
(H the horizon), so its last H steps carry the covariates of the H values it predicts, and a
forecast reads them from the data over its whole horizon. Covariates are standardised with the
mean and std of the training part (a column constant there is only centred).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dptrain.data.datasets.base import Split
from dptrain.data.datasets.spacing import DAY, HOUR, WEEK, parse_times, time_step
from dptrain.errors import ConfigError

YEAR = 365 * DAY
CALENDAR = {
    # name: (the spacing must be below this to give it, how it is encoded)
    "minute": (HOUR, "minute of the hour, as sin and cos"),
    "hour": (DAY, "hour of the day, as sin and cos"),
    "weekday": (WEEK, "day of the week, one-hot (Monday to Sunday)"),
    "dayofyear": (YEAR, "day of the year, as sin and cos"),
    "month": (YEAR, "month of the year, as sin and cos"),
}


def parse_feature_list(spec: str, times: list[str], where: str) -> list[str]:
    """The calendar features `spec` names (comma-separated, or "auto": those the spacing and
    length give: hour and weekday below a day, weekday (and dayofyear over a year) for daily
    values, month for coarser ones).

    Raises:
        ConfigError: an unknown name, no dates in the time column, or a feature the spacing
            cannot give (hour of daily values).
    """
    step = time_step(times)
    if spec == "auto":
        if step is None:
            return []
        span = (len(times) - 1) * step
        if step < DAY:
            return ["hour", "weekday"]
        if step < WEEK:
            return ["weekday"] + (["dayofyear"] if span >= YEAR else [])
        return ["month"] if step < YEAR else []
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in CALENDAR:
            raise ConfigError(f"--time-features: unknown feature {name!r}; known: "
                              f"{', '.join(CALENDAR)} or auto")
    if names and step is None:
        raise ConfigError(f"{where}: --time-features {spec} needs dates in the time column "
                          f"(ISO, such as 2024-01-31 or 2024-01-31T13:00), got {times[0]!r}")
    for name in names:
        if step >= CALENDAR[name][0]:
            raise ConfigError(f"{where}: --time-features {name}: the time column is spaced "
                              f"{_duration(step)}, too coarse for the {CALENDAR[name][1]}")
    return list(dict.fromkeys(names))


def time_features(times: list[str], names: list[str]) -> tuple[np.ndarray, list[str]]:
    """(T, C) calendar features of the `times` and the names of their C columns."""
    parsed = parse_times(times)
    columns, labels = [], []
    if parsed is None or not names:
        return np.zeros((len(times), 0)), []
    seconds = (parsed - parsed.astype("datetime64[D]")).astype(np.int64)
    days = parsed.astype("datetime64[D]")
    for name in names:
        if name == "weekday":  # 1970-01-01 was a Thursday: Monday is 0
            weekday = (days.astype(np.int64) + 3) % 7
            columns += [(weekday == d).astype(np.float64) for d in range(7)]
            labels += [f"weekday{d}" for d in range(7)]
            continue
        if name == "minute":
            phase = (seconds % 3600) / 3600
        elif name == "hour":
            phase = seconds / DAY
        elif name == "dayofyear":
            phase = (days - days.astype("datetime64[Y]")).astype(np.int64) / 365.25
        else:  # month
            phase = (days.astype("datetime64[M]").astype(np.int64) % 12) / 12
        columns += [np.sin(2 * np.pi * phase), np.cos(2 * np.pi * phase)]
        labels += [f"{name}_sin", f"{name}_cos"]
    return np.stack(columns, 1), labels


def with_covariates(split: Split, values: np.ndarray, names: list[str]) -> Split:
    """The split whose windows pair each input value with covariates (module docstring),
    `values` (T, C) appended to those the split has, standardised on the training part.

    Raises:
        ConfigError: a covariate with a missing value (a known covariate is known everywhere).
    """
    series = split.series
    if not names:
        return split
    raw = torch.from_numpy(np.asarray(values, dtype=np.float64))  # (T, C)
    missing = ~torch.isfinite(raw)
    if missing.any():
        t, c = (int(i) for i in missing.nonzero()[0])
        raise ConfigError(f"{split.name}: covariate {names[c]!r} is missing at time "
                          f"{series.times[t]!r}; a known covariate needs a value at every "
                          f"time step, the test part's included")
    train = raw[:series.train_end]
    std = train.std(0, unbiased=False)
    scaled = ((raw - train.mean(0)) / torch.where(std > 0, std, 1.0)).float()
    if series.covariates is not None:
        scaled = torch.cat([series.covariates, scaled], 1)
        names = [*series.covariate_names, *names]
    new = dataclasses.replace(series, covariates=scaled, covariate_names=list(names))
    parts = {name: getattr(split, name).with_covariates(scaled)
             for name in ("train", "test", "validation")}
    return dataclasses.replace(split, **parts, series=new)


def _duration(seconds: int) -> str:
    for unit, size in (("week", WEEK), ("day", DAY), ("hour", HOUR), ("minute", 60)):
        if seconds % size == 0:
            n = seconds // size
            return f"{n} {unit}{'s' if n > 1 else ''}"
    return f"{seconds} s"
