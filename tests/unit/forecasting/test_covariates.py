"""Known covariates of time series (calendar features of the time column, known columns of a
wide CSV): their encoding, their place in a window (the covariates of the time H steps on),
forecasts that read them from the data over the horizon, one-line errors for what cannot be
given, and the calibrated tagi-lstm that beats the seasonal naive forecast on the generated
`hourly` series, better with calendar covariates than without (issue 28)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import shutil
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.cli.main import build_parser, main
from dptrain.cli.train import options_from_args
from dptrain.data.config import NO_VALIDATION, DataConfig, load_split
from dptrain.data.datasets.covariates import parse_feature_list, time_features
from dptrain.runtime import Runtime
from dptrain.runtime.env import SINGLE
from dptrain.errors import ConfigError, DataError
from dptrain.learners.build import create_learner, create_model, model_defaults, model_split
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.learners.forecast import calibrated_test, forecast_metrics, forecast_test, naive_test
from dptrain.train.job import run_training
from dptrain.train.options import TrainOptions, as_saved, run_record

DATA = Path(__file__).resolve().parents[2] / "data"


def _hours(n: int) -> list[str]:
    return [str(np.datetime64("2024-01-01T00:00") + np.timedelta64(h, "h")) for h in range(n)]


def _csv(path, n: int = 200):
    t = np.arange(n)
    lines = ["time,load,temp,holiday"] + [
        f"{_hours(n)[k]},{10 + np.sin(k / 3):.4f},{20 + k % 24},{int(k % 168 < 24)}"
        for k in t]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_calendar_features_encode_the_time():
    times = ["2024-01-01T06:00", "2024-01-06T18:00"]  # a Monday morning, a Saturday evening
    values, names = time_features(times, ["hour", "weekday"])
    assert names == ["hour_sin", "hour_cos"] + [f"weekday{d}" for d in range(7)]
    np.testing.assert_allclose(values[:, :2], [[1.0, 0.0], [-1.0, 0.0]], atol=1e-12)
    assert values[0, 2:].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert values[1, 2:].tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert parse_feature_list("auto", _hours(10), "x") == ["hour", "weekday"]
    days = [str(np.datetime64("2024-01-01") + d) for d in range(400)]
    assert parse_feature_list("auto", days, "x") == ["weekday", "dayofyear"]
    assert parse_feature_list("auto", ["0", "1"], "x") == []


@pytest.mark.parametrize("spec, times, message", [
    ("hour", [f"2024-01-{d:02d}" for d in range(1, 9)],
     "x: --time-features hour: the time column is spaced 1 day, too coarse for the hour of "
     "the day"),
    ("weekday", ["0", "1", "2"], "x: --time-features weekday needs dates in the time column"),
    ("season", ["2024-01-01"], "--time-features: unknown feature 'season'; known: minute, "
                               "hour, weekday, dayofyear, month or auto"),
])
def test_a_calendar_feature_the_times_cannot_give_is_one_line(spec, times, message):
    with pytest.raises(ConfigError) as err:
        parse_feature_list(spec, times, "x")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_each_input_step_carries_the_covariates_of_the_time_a_horizon_on(tmp_path):
    path = _csv(tmp_path / "load.csv")
    split = load_split(DataConfig(dataset=f"series:{path}", lookback=4, horizon=2,
                                  covariates="temp,holiday", time_features="hour"), seed=0)
    series = split.series
    assert series.names == ["load"] and series.num_features == 5
    assert series.covariate_names == ["temp", "holiday", "hour_sin", "hour_cos"]
    train = series.covariates[:series.train_end]  # standardised on the training part
    torch.testing.assert_close(train.mean(0), torch.zeros(4), atol=1e-5, rtol=0)
    assert split.input_shape == (4 * 5,)
    x, y = split.train[3]
    start = int(split.train.start[3])
    steps = x.reshape(4, 5)
    torch.testing.assert_close(steps[:, 0], series.inputs()[0, start - 4:start].float())
    torch.testing.assert_close(steps[:, 1:], series.covariates[start - 4 + 2:start + 2])
    # the model reads 4 steps of 5 values, and so does the id-embedding network
    model, _ = create_model(ModelConfig(model="tagi-lstm", hidden=4), split, seed=0)
    assert model.layers[0].input_size == 5 and model.layers[0].seq_len == 4


def test_a_forecast_reads_the_known_covariates_over_its_horizon(tmp_path):
    split = load_split(DataConfig(dataset=f"series:{_csv(tmp_path / 'l.csv')}", lookback=3,
                                  horizon=2, covariates="temp"), seed=0)
    series = split.series
    seen = []

    def spy(mu_x, var_x):
        seen.append((mu_x.clone(), var_x.clone()))
        return mu_x[:, -2:-1].repeat(1, 2), var_x[:, -2:-1].repeat(1, 2) + 1

    forecast_test(spy, series)
    start = series.val_end
    for call, (mu_x, var_x) in enumerate(seen[:3]):
        end = start + 2 * call  # this call predicts steps end and end + 1
        cov = mu_x[0].reshape(3, 2)[:, 1]
        torch.testing.assert_close(cov, series.covariates[end - 3 + 2:end + 2, 0])
        assert not var_x[0].reshape(3, 2)[:, 1].any()  # known: variance 0
    assert seen[1][1][0].reshape(3, 2)[1:, 0].tolist() == [1.0, 1.0]  # predictions fed back


def test_bad_covariates_are_one_line_before_training(tmp_path):
    path = _csv(tmp_path / "load.csv")
    with pytest.raises(DataError, match=r"load.csv: covariate column 'price' is not in the "
                                        r"file; its columns: load, temp, holiday"):
        load_split(DataConfig(dataset=f"series:{path}", covariates="temp,price"), seed=0)
    with pytest.raises(ConfigError, match="--covariates: columns of a series:PATH.csv file; "
                                          "hourly has none"):
        load_split(DataConfig(dataset="hourly", covariates="temp"), seed=0)
    gap = tmp_path / "gap.csv"
    gap.write_text(path.read_text().replace(",21,", ",,", 1))
    with pytest.raises(ConfigError, match="covariate 'temp' is missing at time "
                                          "'2024-01-01T01:00'"):
        load_split(DataConfig(dataset=f"series:{gap}", covariates="temp"), seed=0)


def test_tagi_lstm_takes_calendar_features_and_two_days_by_default_on_series():
    """tagi-lstm's defaults on a time series: --time-features auto (hour and weekday of
    hourly dates, none for times that are not dates) and --lookback 48; --time-features ""
    turns the features off. Other models keep none and 24; data that is not a series gets
    no series option from the model (which it would refuse)."""
    def options(*flags):
        return options_from_args(build_parser().parse_args(["train", *flags]))

    lstm = options("--model", "tagi-lstm", "--dataset", "hourly")
    assert (lstm.time_features, lstm.lookback) == ("auto", 48)
    assert options("--model", "tagi-lstm", "--dataset", "series:x.csv", "--time-features",
                   "").time_features == ""
    mlp = options("--model", "tagi-mlp", "--dataset", "hourly")
    assert (mlp.time_features, mlp.lookback) == ("", 24)
    digits = options("--model", "tagi-lstm", "--dataset", "digits")
    assert (digits.time_features, digits.lookback) == ("", 24)
    hourly = load_split(DataConfig(dataset="hourly", time_features="auto"), seed=0).series
    assert hourly.covariate_names == ["hour_sin", "hour_cos"] + [f"weekday{d}" for d in range(7)]
    assert parse_feature_list("auto", ["0", "1", "2"], "x") == []


def test_a_record_from_before_a_model_default_changed_resumes_with_the_old_value():
    """A tagi-lstm record that lacks time_features (or holds heteroscedastic false, no
    calendar features or a lookback of 24, as a run started with those) resumed with them
    left at the model's defaults goes on with the recorded values; one given otherwise stays
    and is refused."""
    today = options_from_args(build_parser().parse_args(["train", "--model", "tagi-lstm",
                                                         "--dataset", "seasonal"]))
    assert today.heteroscedastic and (today.time_features, today.lookback) == ("auto", 48)
    old = {k: v for k, v in run_record(today).items() if k != "time_features"}
    resumed = as_saved(today, {**old, "heteroscedastic": False, "lookback": 24})
    assert not resumed.heteroscedastic and (resumed.time_features, resumed.lookback) == ("", 24)
    assert as_saved(today, {**old, "lookback": 36}).lookback == 48, "refused by the record"
    assert as_saved(today, run_record(today)) == today  # today's run: nothing changes
    told = as_saved(dataclasses.replace(today, time_features="hour"), old)
    assert told.time_features == "hour", "a value given is kept (and refused by the record)"
    mlp = TrainOptions(model="tagi-mlp", dataset="seasonal")
    assert as_saved(mlp, {**run_record(mlp), "heteroscedastic": False}) == mlp


#: How far a figure of epochs.csv computed here may lie from the one the old dptrain recorded on
#: its machine (relative). The run computes in float32; which kernels BLAS and torch pick (AVX2 or
#: AVX-512, MKL's Intel or AMD path) changes the last bits of every step, and two epochs of the
#: LSTM carry that into the 8th significant digit (an AMD EPYC: -5.0402471619 against the
#: recorded -5.0402470820, 1.6e-8; tests/e2e/test_other_kernels.py's kernels: 1.5e-8). 1e-5 leaves
#: a margin of several hundred over that, and a change of what the run computes moves these
#: figures by far more (mutation tried: the step cap's factor 2 made 2.02 moves the second
#: epoch's train log-likelihood by 7e-4 relative, failing here).
RECORDED_RTOL = 1e-5
#: Interval coverages count samples: one whose value lies at an interval's edge may cross it
#: under other rounding; two of the 384 test windows (seven of the 1312 training ones).
RECORDED_COVERAGE_ATOL = 2 / 384


def _assert_figures_close(got: str, recorded: str) -> None:
    """Two epochs.csv texts hold the same rows and columns, each figure within the tolerances
    above (epoch and step exactly)."""
    got_rows, want_rows = (list(csv.DictReader(io.StringIO(text))) for text in (got, recorded))
    assert [list(r) for r in got_rows] == [list(r) for r in want_rows], "the same columns"
    assert len(got_rows) == len(want_rows), (got, recorded)
    for got_row, want_row in zip(got_rows, want_rows):
        for name, want in want_row.items():
            if name in ("epoch", "step"):
                assert got_row[name] == want, (name, got_row, want_row)
                continue
            tolerance = RECORDED_COVERAGE_ATOL if "coverage" in name else 0.0
            assert float(got_row[name]) == pytest.approx(float(want), rel=RECORDED_RTOL,
                                                         abs=tolerance), (name, got_row, want)


@pytest.mark.recorded
def test_a_tagi_lstm_run_written_before_learned_noise_resumes_as_it_began(tmp_path):
    """tests/data/run_before_covariates: `dptrain train --model tagi-lstm --dataset seasonal
    --nproc 1 --epochs 1 --lookback 8 --keep-last 1` run by the dptrain before calendar
    features and learned noise were tagi-lstm's defaults (its record: heteroscedastic false,
    no time_features, no val_size). Resumed by today's command with no new flag, it goes on
    with the fixed σ_v, no covariates and no validation part, as that dptrain did. Stepped
    eagerly, as that dptrain stepped (`--no-compile`: today's default, the native step,
    agrees with eager to float32 rounding, not byte for byte).

    Byte for byte, on this machine: the options today's command resumes that record with
    (`as_saved`), run unbroken for two epochs, write the epochs.csv that a one-epoch run of
    them ends with once its checkpoint carries the old record verbatim and today's command
    resumes it. Against the files recorded on the old dptrain's machine (epochs.csv and
    epochs_unbroken.csv, two epochs unbroken): the resumed run keeps the recorded first
    epoch byte for byte (it is read, not recomputed), and every figure it and the unbroken
    run computed here lies within RECORDED_RTOL of the recorded ones, a tolerance another
    CPU's kernels cannot break: docs/design.md, contract 12."""
    old = json.loads((DATA / "run_before_covariates" / "checkpoints" / "step-00000082"
                      / "meta.json").read_text())["run_record"]
    command = ["train", "--model", "tagi-lstm", "--dataset", "seasonal", "--nproc", "1",
               "--lookback", "8", "--keep-last", "1", "--no-progress", "--no-compile"]
    resuming = as_saved(options_from_args(build_parser().parse_args([*command, "--epochs", "2"])),
                        old)
    assert (resuming.heteroscedastic, resuming.time_features, resuming.val_size) == \
        (False, "", NO_VALIDATION), resuming
    run_training(dataclasses.replace(resuming, out=str(tmp_path / "unbroken")))
    run_training(dataclasses.replace(resuming, epochs=1, out=str(tmp_path / "here")))
    meta_path = tmp_path / "here" / "checkpoints" / "step-00000082" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "run_record": old}))  # as the old dptrain wrote it
    assert main([*command, "--epochs", "2", "--out", str(tmp_path / "here")]) == 0
    unbroken = (tmp_path / "unbroken" / "epochs.csv").read_text()
    assert (tmp_path / "here" / "epochs.csv").read_text() == unbroken

    run = Path(shutil.copytree(DATA / "run_before_covariates", tmp_path / "run"))
    assert main([*command, "--epochs", "2", "--out", str(run)]) == 0
    resumed = (run / "epochs.csv").read_text()
    assert resumed.startswith((DATA / "run_before_covariates" / "epochs.csv").read_text())
    recorded = (run / "epochs_unbroken.csv").read_text()
    _assert_figures_close(resumed, recorded)
    _assert_figures_close(unbroken, recorded)
    for out in (run, tmp_path / "here"):
        record = json.loads((out / "checkpoints" / "step-00000164" / "meta.json").read_text())
        assert record["run_record"]["heteroscedastic"] is False
        assert record["run_record"]["time_features"] == ""


def _long(wide_path, path, shuffle: bool = True):
    """The wide file of `_csv` in the long layout: a row per (time, series), each repeating
    the shared covariates, in a shuffled order; a second series, the first one doubled."""
    header, *rows = wide_path.read_text().splitlines()
    lines = []
    for row in rows:
        time, load, temp, holiday = row.split(",")
        lines += [f"{time},north,{load},{temp},{holiday}",
                  f"{time},south,{2 * float(load):.4f},{temp},{holiday}"]
    order = np.random.default_rng(0).permutation(len(lines)) if shuffle else range(len(lines))
    path.write_text("\n".join(["time,series,value,temp,holiday", *(lines[i] for i in order)])
                    + "\n")
    return path


def test_a_long_file_carries_known_covariates_as_the_wide_one_does(tmp_path):
    """--covariates in the long layout: columns beside time, id and value, the same for every
    series at one time (each row repeats them); read as the wide file's columns. A column
    not named is an error (which column is the value?), and so is a covariate that differs
    between two series' rows of one time, naming both lines."""
    wide = _csv(tmp_path / "wide.csv")
    long = _long(wide, tmp_path / "long.csv")
    config = {"lookback": 4, "horizon": 2, "covariates": "temp,holiday"}
    w = load_split(DataConfig(dataset=f"series:{wide}", **config), seed=0)
    lo = load_split(DataConfig(dataset=f"series:{long}", **config), seed=0)
    assert sorted(lo.series.names) == ["north", "south"]  # in order of first appearance
    north = lo.series.names.index("north")
    assert lo.series.covariate_names == w.series.covariate_names == ["temp", "holiday"]
    torch.testing.assert_close(lo.series.covariates, w.series.covariates)
    torch.testing.assert_close(lo.series.values[north], w.series.values[0])
    first = lo.train.series == north  # north's windows: (value, temp, holiday) at each step
    torch.testing.assert_close(lo.train.x[first][:3], w.train.x[:3])
    with pytest.raises(DataError) as err:
        load_split(DataConfig(dataset=f"series:{long}", covariates="temp"), seed=0)
    assert "long.csv: a long-format series CSV has exactly three columns (time, series, " \
           "value) besides the known covariates named by --covariates" in str(err.value)
    assert "name holiday in --covariates, or leave it out" in str(err.value)
    with pytest.raises(DataError, match="covariate column 'price' is not in the file; its "
                                        "columns: time, series, value, temp, holiday"):
        load_split(DataConfig(dataset=f"series:{long}", covariates="temp,holiday,price"),
                   seed=0)
    text = _long(wide, tmp_path / "ordered.csv", shuffle=False).read_text().splitlines()
    text[2] = text[2].replace(",20,", ",25,")  # south's temp at the first time
    (tmp_path / "clash.csv").write_text("\n".join(text) + "\n")
    with pytest.raises(DataError, match=r"clash.csv: line 3: covariate 'temp' is 25 at time "
                                        r"'2024-01-01T00:00', 20 on line 2; a known covariate "
                                        r"is shared by every series"):
        load_split(DataConfig(dataset=f"series:{tmp_path / 'clash.csv'}",
                              covariates="temp,holiday"), seed=0)


def _train(split, config: ModelConfig, epochs: int, seed: int = 0):
    defaults = model_defaults("tagi-lstm")
    data = model_split(config, split)
    learner = create_learner(config, LearnerConfig(sigma_v=defaults["sigma_v"]), data,
                             seed=seed)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(data.train), generator=gen).split(defaults["batch_size"]):
            learner.train_step(data.train[idx])
    return learner, data


HOURLY_ND = {0: (0.090, 0.142), 24: (0.086, 0.106)}
"""(model, seasonal naive) ND on `hourly` at tagi-lstm's defaults, seed 0, by protocol (the
whole test part, rolled daily), as measured here; the README and docs/tutorials/forecasting.md quote
them (tests/unit/test_readme_figures.py)."""
ND_ROUNDING = 0.005
"""How far another CPU's float32 rounding may move the model's ND after 10 epochs."""


@pytest.mark.slow
@pytest.mark.recorded
def test_the_registry_s_lstm_beats_seasonal_naive_on_hourly_series_at_its_defaults():
    """Learning: on `hourly` (6 series, daily cycles whose amplitude depends on the weekday,
    noise levels of their own, missing values) the registry's tagi-lstm with every default
    (learned noise, calendar features auto, lookback 48, 10 epochs) forecasts the test part,
    as the run reports it (the variance scale chosen on validation), with an ND at least 10 %
    below the seasonal naive forecast's (the better of yesterday and last week, chosen on
    validation), both as one forecast of the whole test part (the default protocol) and
    rolled daily, and with 85-100 % of the values in its ±2σ interval; without the calendar
    features (--time-features "") its ND is higher, since a lookback of two days cannot see
    the weekday. Measured (seed 0), whole test part / rolled daily: ND 0.090 / 0.086 with
    (`HOURLY_ND`, quoted by the README and docs/tutorials/forecasting.md), 0.125 / 0.0995 without,
    naive 0.142 / 0.106; coverage 0.95 / 0.93 with, 0.91 / 0.93 without. (Seeds 1 and 2:
    0.090 and 0.089 / 0.086 and 0.085 with. A lookback of 24 gave 0.104, 0.101 and 0.129
    over the whole test part: not 10 % below the naive forecast on seed 2.)"""
    defaults = model_defaults("tagi-lstm")
    assert defaults["time_features"] == "auto"
    config = ModelConfig(model="tagi-lstm", hidden=defaults["hidden"],
                         heteroscedastic=defaults["heteroscedastic"])
    nd, naive_nd = {}, {}
    for features in (defaults["time_features"], ""):
        split = load_split(DataConfig(dataset="hourly", lookback=defaults["lookback"],
                                      time_features=features), seed=0)
        learner, data = _train(split, config, epochs=TrainOptions().epochs)
        for every in (0, 24):
            series = dataclasses.replace(data.series, forecast_every=every)
            forecast, _ = calibrated_test(learner.predict_moments, series)
            metrics = forecast_metrics(forecast, series)
            naive = forecast_metrics(naive_test(series)[0], series)
            assert 0.85 <= metrics["coverage_2sigma"] <= 1.0, (features, every, metrics)
            assert math.isfinite(naive["log_likelihood"])
            nd[features, every], naive_nd[every] = metrics["nd"], naive["nd"]
    for every in (0, 24):
        assert nd["auto", every] <= 0.9 * naive_nd[every], (nd, naive_nd)
        assert nd["auto", every] < nd["", every], nd
        model, naive = HOURLY_ND[every]
        assert abs(nd["auto", every] - model) < ND_ROUNDING and \
            naive_nd[every] == pytest.approx(naive, abs=5e-4), (every, nd, naive_nd)


@pytest.mark.slow
@pytest.mark.parametrize("dataset, lookback", [("seasonal", 24), ("seasonal", None),
                                               ("sine", 24)])
def test_a_one_step_forecast_of_the_whole_test_part_is_calibrated(dataset, lookback):
    """The default protocol with a horizon of 1 (the test part forecast in one go, each value
    fed back 96 or 232 times): the registry's tagi-lstm at its defaults (lookback 48, or 24)
    covers 85-100 % of the test values with its ±2σ interval, as the run reports it. Its
    variance scale scores the validation values at the test forecast's lead times: scaled by
    the validation part's own 48 leads, `seasonal` at lookback 24 was covered 84 % (95 % over
    the first quarter of the test part, 75 % over the last). Measured (seed 0): 92.7 % and
    90.6 % on seasonal, 96.1 % on sine."""
    defaults = model_defaults("tagi-lstm")
    config = ModelConfig(model="tagi-lstm", hidden=defaults["hidden"],
                         heteroscedastic=defaults["heteroscedastic"])
    split = load_split(DataConfig(dataset=dataset, lookback=lookback or defaults["lookback"],
                                  time_features=defaults["time_features"]), seed=0)
    learner, data = _train(split, config, epochs=TrainOptions().epochs)
    forecast, _ = calibrated_test(learner.predict_moments, data.series)
    assert forecast.origins.unique().tolist() == [data.series.val_end]
    metrics = forecast_metrics(forecast, data.series)
    assert 0.85 <= metrics["coverage_2sigma"] <= 1.0, metrics
