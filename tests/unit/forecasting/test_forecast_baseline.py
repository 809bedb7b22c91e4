"""The seasonal naive baseline beside every forecast (its season from the time spacing, chosen
on the validation part, never on the test part), rolling-origin evaluation, and series that are
constant or nearly empty over their training part kept or left out without stopping the run
(issue 28)."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch

from dptrain.data.config import DataConfig, load_split, with_protocol
from dptrain.data.datasets.series import series_split
from dptrain.data.datasets.spacing import season_candidates, time_step
from dptrain.errors import ConfigError, DataError
from dptrain.learners.forecast import (
    calibrated_test,
    forecast_report,
    forecast_test,
    naive_test,
    protocol,
    seasonal_naive,
)
from dptrain.train.job import headline


def _hours(n: int) -> list[str]:
    return [str(np.datetime64("2024-01-01T00:00") + np.timedelta64(h, "h")) for h in range(n)]


def _split(values: np.ndarray, times=None, lookback: int = 4, **fractions):
    names = [f"s{i}" for i in range(len(values))]
    return series_split("t", names, times or _hours(values.shape[1]), values,
                        lookback=lookback, horizon=1, **fractions)


def test_the_season_comes_from_the_time_spacing():
    assert time_step(_hours(5)) == 3600
    assert season_candidates(_hours(5)) == (24, 168)
    half_hours = [str(np.datetime64("2024-01-01T00:00") + np.timedelta64(30 * k, "m"))
                  for k in range(5)]
    assert season_candidates(half_hours) == (48, 336)
    assert season_candidates(["2024-01-01", "2024-01-02", "2024-01-03"]) == (7, 365)
    assert season_candidates(["2024-01-01 00:00", "2024-01-01 01:00"]) == (24, 168)
    assert season_candidates(["2024-01-31", "2024-02-29", "2024-03-31"]) == (12,)
    assert season_candidates(["0", "1", "2"]) == () and time_step(["a", "b"]) is None
    numbered = _split(np.arange(60.0)[None] % 5, times=[str(t) for t in range(60)])
    assert numbered.series.seasons == (1,)  # no spacing: the last value
    assert dataclasses.replace(numbered.series, season=5).seasons == (5,)


def test_seasonal_naive_repeats_the_last_season_with_growing_variance():
    t = np.arange(120.0)
    values = (t % 24)[None] + 0.5 * (t // 24)[None]  # a daily saw rising half a unit a day
    series = _split(values).series  # train 84, validation 12, test 24 steps
    naive = seasonal_naive(series, 96, 120, 24)
    torch.testing.assert_close(naive.mean[0], torch.from_numpy(values[0, 72:96]).float())
    # every training difference one day apart is 0.5: σ² 0.25 for the first season ahead
    assert naive.var[0].tolist() == pytest.approx([0.25] * 24)
    longer = seasonal_naive(series, 84, 120, 24)  # 36 steps: the second day repeats it again
    assert longer.var[0, 24:].tolist() == pytest.approx([0.5] * 12)
    torch.testing.assert_close(longer.mean[0, 24:], longer.mean[0, :12])


def test_the_naive_season_is_chosen_on_validation_never_on_test():
    """Hourly data whose weekdays differ: the weekly naive wins on validation; the test part
    can be anything without changing the choice."""
    t = np.arange(24 * 7 * 6, dtype=np.float64)
    weekly = 10 + np.sin(2 * np.pi * t / 24) * np.where((t // 24) % 7 >= 5, 0.2, 3.0)
    series = _split(weekly[None], train_fraction=0.6, val_fraction=0.2).series
    _, season = naive_test(series)
    assert season == 168
    scrambled = series.values.clone()
    scrambled[:, series.val_end:] = torch.randn(1, scrambled.shape[1] - series.val_end) * 50
    _, season = naive_test(dataclasses.replace(series, values=scrambled))
    assert season == 168
    daily = 10 + np.sin(2 * np.pi * t / 24) + 0.01 * np.cos(t)
    _, season = naive_test(_split(daily[None], train_fraction=0.6, val_fraction=0.2).series)
    assert season == 24


def test_rolling_origins_reveal_what_they_forecast():
    assert protocol(10, 30, 0) == [(10, 20)]
    assert protocol(10, 30, 8) == [(10, 8), (18, 8), (26, 4)]
    t = np.arange(120.0)
    series = dataclasses.replace(_split((t % 24)[None] + t[None] / 24).series,
                                 forecast_every=5)
    calls = []

    def last_value(mu_x, var_x):
        calls.append(mu_x.clone())
        return mu_x[:, -1:], var_x[:, -1:] + 1.0

    forecast = forecast_test(last_value, series)
    assert forecast.origins.tolist() == [96 + 5 * (k // 5) for k in range(24)]
    assert len(calls) == 5 and calls[0].shape == (5, 4)  # 5 origins in one batch, 5 steps
    # each origin starts from the last value observed before it, with variance 0 again
    for k, origin in enumerate(range(96, 120, 5)):
        assert forecast.mean[0, k * 5].item() == pytest.approx(series.values[0, origin - 1])
        assert forecast.var[0, k * 5] == pytest.approx(series.norm.std.item() ** 2)
    naive = seasonal_naive(series, 96, 120, 24)  # origins too: from 101 on, 101 - 24 + j
    assert naive.mean[0, 5].item() == pytest.approx(series.values[0, 77].item())


def test_the_report_puts_the_naive_beside_every_metric_and_in_the_final_line(tmp_path):
    split = load_split(DataConfig(dataset="seasonal", lookback=8, forecast_every=24), seed=0)

    def persistence(mu_x, var_x):
        return mu_x[:, -1:], var_x[:, -1:] + 0.5

    report = forecast_report(persistence, split.series, tmp_path)
    metrics = ("rmse", "log_likelihood", "coverage_1sigma", "coverage_2sigma",
               "coverage_3sigma", "nd", "p90_loss", "mase", "mase_seasonal")
    for name in metrics:
        assert math.isfinite(report[f"forecast_{name}"]) and f"forecast_{name}_naive" in report
    assert report["forecast_every"] == 24 and report["forecast_season"] == 24
    assert report["forecast_naive_season"] in (24, 168)
    assert (tmp_path / "forecast.png").stat().st_size > 0
    # persistence of the last value is far worse than repeating yesterday on daily cycles
    assert report["forecast_nd"] > report["forecast_nd_naive"]
    line = headline({"test_rmse": 1.0, **report}, "regression")
    assert f"ND {report['forecast_nd']:.3f} (seasonal naive " \
           f"{report['forecast_nd_naive']:.3f})" in line
    assert f"3σ {100 * report['forecast_coverage_3sigma']:.1f} %" in line.split("forecast")[-1]
    assert (f"log-likelihood {report['forecast_log_likelihood']:.4g} (seasonal naive "
            f"{report['forecast_log_likelihood_naive']:.4g}, 2σ "
            f"{100 * report['forecast_coverage_2sigma_naive']:.1f} %)") in line


def test_the_variance_scale_is_chosen_on_validation_never_on_test():
    """A forecaster whose variance is 4 times too small is widened by the scale that the
    validation part's forecast asks for; a scrambled test part does not move it."""
    t = np.arange(24 * 30, dtype=np.float64)
    noisy = 10 + np.sin(2 * np.pi * t / 24) + np.random.default_rng(0).normal(0, 0.5, len(t))
    series = dataclasses.replace(_split(noisy[None], lookback=24).series, forecast_every=24)
    std = series.norm.std.item()

    def yesterday(mu_x, var_x):  # the value a day back; variance 1/4 of the truth
        return mu_x[:, :1], var_x[:, :1] + 0.25 * (2 * 0.5 ** 2) / std ** 2

    forecast, scale = calibrated_test(yesterday, series)
    assert scale == pytest.approx(4.0, rel=0.35)
    torch.testing.assert_close(forecast.var, forecast_test(yesterday, series).var * scale)
    scrambled = series.values.clone()
    scrambled[:, series.val_end:] += 100.0
    _, again = calibrated_test(yesterday, dataclasses.replace(series, values=scrambled))
    assert again == scale
    assert "forecast_variance_scale" in forecast_report(yesterday, series, None)


@pytest.mark.parametrize("every, leads", [(0, 40), (10, 10), (30, 30)])
def test_the_variance_scale_scores_validation_at_the_test_forecast_s_lead_times(every, leads):
    """A recursive forecast errs more the further it runs: the scale is chosen on validation
    values forecast at the leads the test protocol forecasts at, each about once. Here a
    forecaster that repeats the last value with variance 1 (standardised) on a straight line
    errs by k/std at lead k, so c = mean of k² over the leads scored: 1 to 40 for one forecast
    of the 40 test steps (from origins 20 apart, the validation part's length), where the
    validation part's own 20 steps gave 1 to 20 only and intervals too narrow for the test
    part's last half; 1 to 10 twice for daily-style origins 10 apart; 1 to 30 for origins
    30 apart."""
    series = dataclasses.replace(_split(np.arange(200.0)[None]).series, forecast_every=every)
    assert (series.train_end, series.val_end) == (140, 160)

    def last_value(mu_x, var_x):
        return mu_x[:, -1:], torch.ones_like(var_x[:, -1:])

    _, scale = calibrated_test(last_value, series)
    k = np.arange(1, leads + 1)
    assert scale * series.norm.std.item() ** 2 == pytest.approx(np.mean(k ** 2), rel=1e-4)


@pytest.mark.parametrize("options, message", [
    ({"forecast_every": -1}, "forecast-every: expected an integer >= 0, got -1"),
    ({"season": -2}, "season: expected an integer >= 0, got -2"),
])
def test_bad_protocol_options_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(dataset="sine", **options)


def test_a_protocol_the_series_cannot_hold_is_refused_before_training():
    split = load_split(DataConfig(dataset="sine"), seed=0)  # 232 test days, 809 training
    with pytest.raises(ConfigError, match=r"sine: --forecast-every 233 is larger than the test "
                                          r"part \(232 time steps\)"):
        with_protocol(split, forecast_every=233)
    with pytest.raises(ConfigError, match="sine: --season 810 is longer than the training part"):
        with_protocol(split, season=810)
    with pytest.raises(ConfigError, match="season: for time series"):
        load_split(DataConfig(dataset="digits", season=7), seed=0)
    assert with_protocol(split, forecast_every=232).series.forecast_every == 232


def test_a_constant_and_an_empty_series_do_not_stop_the_others(tmp_path, caplog):
    """A dead meter (all zeros) and a constant one are kept with the typical scale, named in one
    warning line; a series with one observed training value is left out, named in one line;
    the rest train and forecast."""
    t = np.arange(200.0)
    values = np.stack([10 + np.sin(t / 4), np.zeros(200), np.full(200, 7.0),
                       np.full(200, np.nan), 5 + np.cos(t / 3)])
    values[3, 150:] = 1.0  # observed only after its training part
    values[3, 3] = 2.0
    path = tmp_path / "meters.csv"
    rows = ["time,live,dead,flat,late,other"] + [
        f"{int(k)}," + ",".join("" if math.isnan(v) else f"{v:g}" for v in values[:, k])
        for k in range(200)]
    path.write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="dptrain.data.datasets.series"):
        split = load_split(DataConfig(dataset=f"series:{path}", lookback=4), seed=0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert "1 series left out" in lines[0] and "'late' (1)" in lines[0]
    assert "2 series constant" in lines[1] and "'dead' (0)" in lines[1] \
        and "'flat' (7)" in lines[1]
    series = split.series
    assert series.names == ["live", "dead", "flat", "other"]
    # the constant ones are scaled like the typical series (the median std of the others),
    # never by an arbitrary 1 or |mean|: their later values stay of the others' order
    live, other = series.norm.std[0, 0].item(), series.norm.std[3, 0].item()
    typical = min(live, other)  # torch's median of two is the lower one
    assert series.norm.std[:, 0].tolist() == pytest.approx([live, typical, typical, other])
    assert torch.isfinite(split.train.x).all()
    forecast = forecast_test(lambda m, v: (m[:, -1:], v[:, -1:] + 1.0), series)
    assert torch.isfinite(forecast.mean).all() and torch.isfinite(forecast.var).all()
    naive, _ = naive_test(series)
    assert (naive.var > 0).all()  # a constant series' naive variance is small, never 0


def test_a_file_of_empty_series_is_one_line(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("time,a,b\n" + "".join(f"{k},,\n" for k in range(40)).replace(
        "39,,", "39,1,2"))
    with pytest.raises(DataError, match="no series has 2 observed values in its training part"):
        load_split(DataConfig(dataset=f"series:{path}", lookback=3), seed=0)


@pytest.mark.parametrize("val_days, rule", [(4, "per-series mean"), (1, "fallback")])
def test_one_odd_series_cannot_set_every_series_variance_scale(val_days, rule, caplog):
    """Eight daily-cycle series, one of them tripled from its validation part on (a level
    shift): the pooled mean z² follows that one series, the scale chosen (the mean of the
    per-series scales, each at most 4 times their median; with a validation part of 24 steps, the robust pooled fallback, said in one line
    and in the report) stays within 1 + 3/8 of the others' 4."""
    t = np.arange(24 * 20, dtype=np.float64)
    rng = np.random.default_rng(0)
    values = np.stack([10 + np.sin(2 * np.pi * t / 24 + s) + rng.normal(0, 0.5, len(t))
                       for s in range(8)])
    n_test, n_val = 48, 24 * val_days
    values[0, len(t) - n_test - n_val:] *= 3.0
    split = series_split("t", [f"s{i}" for i in range(8)], _hours(len(t)), values,
                         lookback=24, horizon=1, test_size=n_test, val_size=n_val)
    series = dataclasses.replace(split.series, forecast_every=24)
    std = series.norm.std

    def yesterday(mu_x, var_x):  # the value a day back; variance 1/4 of the truth
        each = std.float().repeat(len(mu_x) // len(std), 1)  # rows: origins x series
        return mu_x[:, :1], var_x[:, :1] + 0.25 * (2 * 0.5 ** 2) / each ** 2

    with caplog.at_level(logging.WARNING, logger="dptrain.learners.forecast"):
        report = forecast_report(yesterday, series, None)
    assert report["forecast_variance_scale_rule"].startswith(rule)
    assert 2.0 < report["forecast_variance_scale"] < 4.0 * (1 + 3 / 8) * 1.3
    assert report["forecast_variance_scale_pooled"] > 3 * report["forecast_variance_scale"]
    said = [r for r in caplog.records if "too short" in r.getMessage()]
    assert len(said) == (rule == "fallback")
