"""Generated time series for tests and demos: pytagi's toy sine, seasonal series with trend, and
hourly series with a weekly pattern, noise levels of their own and missing values.

    from dptrain.data.datasets.synthetic_series import load_sine

    split = load_sine(lookback=24)          # windows of one daily sine, 1156 days
"""

from __future__ import annotations

import numpy as np
import torch

from dptrain.data.datasets.base import Split
from dptrain.data.datasets.series import series_split
from dptrain.errors import ConfigError

SINE_PERIOD = 365.24
"""Days per period of the toy sine: pytagi's is one cycle a year of daily values."""
SINE_LENGTH = 1156
"""Days of the toy sine: pytagi's 924 training and 232 test days."""


def load_sine(*, lookback: int = 24, horizon: int = 1, length: int = SINE_LENGTH,
              period: float = SINE_PERIOD, noise_std: float = 0.3, seed: int = 0,
              val_size: str | int | float | None = None,
              test_size: str | int | float | None = None) -> Split:
    """One series 5·(1 + sin(2πt/period)) + ε, t = 0, 1, ... days, ε ~ N(0, noise_std²):
    the shape of pytagi's toy sine (amplitude 5 around 5), with a little noise so that a
    predictive distribution has something to be calibrated on."""
    _check(length, noise_std)
    t = np.arange(length, dtype=np.float64)
    noise = _noise(seed, (1, length), noise_std)
    values = 5.0 * (1.0 + np.sin(2 * np.pi * t / period))[None] + noise
    return series_split("sine", ["sine"], _days(length), values, lookback=lookback,
                        horizon=horizon, val_size=val_size, test_size=test_size)


def load_seasonal(*, lookback: int = 24, horizon: int = 1, num_series: int = 4,
                  length: int = 480, period: int = 24, noise_std: float = 0.2,
                  seed: int = 0, val_size: str | int | float | None = None,
                  test_size: str | int | float | None = None) -> Split:
    """`num_series` hourly series, each a level, a small linear trend and a daily (`period`)
    cycle with its own amplitude and phase, plus noise ε ~ N(0, noise_std²) relative to the
    amplitude: a global model learns the shared shape across them."""
    _check(length, noise_std)
    if num_series < 1 or period < 2:
        raise ConfigError(f"seasonal needs num_series >= 1 and period >= 2, got {num_series} "
                          f"and {period}")
    rng = np.random.default_rng(seed)
    t = np.arange(length, dtype=np.float64)[None]
    level = rng.uniform(5.0, 50.0, (num_series, 1))
    amplitude = level * rng.uniform(0.2, 0.5, (num_series, 1))
    trend = amplitude * rng.uniform(-1.0, 1.0, (num_series, 1)) / length
    phase = rng.uniform(0.0, 2 * np.pi, (num_series, 1))
    cycle = np.sin(2 * np.pi * t / period + phase) + 0.3 * np.sin(4 * np.pi * t / period)
    values = level + trend * t + amplitude * cycle
    values = values + amplitude * noise_std * rng.standard_normal(values.shape)
    names = [f"series{s}" for s in range(num_series)]
    return series_split("seasonal", names, _hours(length), values, lookback=lookback,
                        horizon=horizon, val_size=val_size, test_size=test_size)


def load_hourly(*, lookback: int = 24, horizon: int = 1, num_series: int = 6,
                length: int = 24 * 7 * 6, missing: float = 0.03, seed: int = 0,
                val_size: str | int | float | None = None,
                test_size: str | int | float | None = None) -> Split:
    """`num_series` hourly series, a week's worth of days from a Monday: each a level, a daily
    profile of its own phase whose amplitude depends on the weekday (lower at weekends, as
    electricity load), noise whose level differs by series (5 to 40 % of the amplitude), and
    a share `missing` of values missing at random; the first series also misses half a day
    in its training part. The data a calibrated forecaster must handle: daily and weekly
    seasonality, per-series noise, gaps."""
    if not 0 <= missing < 0.5:
        raise ConfigError(f"hourly needs a share of missing values in [0, 0.5), got {missing}")
    _check(length, 0.0)
    rng = np.random.default_rng(seed)
    t = np.arange(length, dtype=np.float64)[None]
    hour, day = t % 24, (t // 24) % 7
    level = rng.uniform(10.0, 100.0, (num_series, 1))
    amplitude = level * rng.uniform(0.2, 0.5, (num_series, 1))
    phase = rng.uniform(0.0, 2 * np.pi, (num_series, 1))
    weekday = np.where(day >= 5, rng.uniform(0.3, 0.6, (num_series, 1)), 1.0)
    cycle = np.sin(2 * np.pi * hour / 24 + phase) + 0.4 * np.sin(4 * np.pi * hour / 24 + phase)
    noise = amplitude * rng.uniform(0.05, 0.4, (num_series, 1))
    values = level + amplitude * weekday * cycle + noise * rng.standard_normal((num_series,
                                                                                length))
    values[rng.random(values.shape) < missing] = np.nan
    values[0, length // 3:length // 3 + 12] = np.nan
    names = [f"load{s}" for s in range(num_series)]
    return series_split("hourly", names, _hours(length), values, lookback=lookback,
                        horizon=horizon, val_size=val_size, test_size=test_size)


def _check(length: int, noise_std: float) -> None:
    if length < 8 or noise_std < 0:
        raise ConfigError(f"a generated series needs length >= 8 and noise_std >= 0, got "
                          f"{length} and {noise_std}")


def _noise(seed: int, shape: tuple[int, ...], std: float) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    return (std * torch.randn(shape, generator=gen, dtype=torch.float64)).numpy()


def _hours(length: int) -> list[str]:
    start = np.datetime64("2024-01-01T00:00")  # a Monday
    return [str(start + np.timedelta64(h, "h")) for h in range(length)]


def _days(length: int) -> list[str]:
    start = np.datetime64("2019-01-01")  # pytagi's first day
    return [str(start + np.timedelta64(d, "D")) for d in range(length)]


LOAD_HOURS, LOAD_VAL, LOAD_TEST = 336, 24, 168
"""The generated load file's hours: 144 of training, 24 of validation, the last 168 as test (the
published split of real hourly load data)."""


def write_load_csv(path, *, num_series: int, troubled: bool, seed: int = 0):
    """Hourly load of `num_series` meters over LOAD_HOURS hours as a wide CSV (`series:PATH`),
    each a level with a daily cycle of its own phase and 5 % noise. Troubled, with the shape of
    real load data's trouble: meter 0 dead (zeros) over its training part, then alive; meter 1
    zero until the last hour of its training part; meter 2 tripled from the validation part on
    (a level shift)."""
    rng = np.random.default_rng(seed)
    t = np.arange(LOAD_HOURS)
    values = []
    for _ in range(num_series):
        level = rng.uniform(20, 300)
        cycle = np.sin(2 * np.pi * (t % 24) / 24 - rng.uniform(0, 2 * np.pi))
        values.append(level * (1 + 0.3 * cycle) + rng.normal(0, 0.05 * level, len(t)))
    values = np.array(values)
    if troubled:
        train_end = LOAD_HOURS - LOAD_TEST - LOAD_VAL
        values[0, :train_end] = 0.0
        values[1, :train_end - 1] = 0.0
        values[1, train_end - 1] = 0.5
        values[2, train_end:] *= 3.0
    hours = np.datetime64("2014-01-01T00") + t.astype("timedelta64[h]")
    rows = ["time," + ",".join(f"meter{s}" for s in range(num_series))]
    rows += [f"{hour}," + ",".join(f"{v:.3f}" for v in values[:, i])
             for i, hour in enumerate(hours)]
    path.write_text("\n".join(rows) + "\n")
    return path
