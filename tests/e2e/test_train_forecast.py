"""`dptrain train` on a time-series CSV end to end: a global model with an embedding of the
series id and calendar covariates on two processes (one of the series a dead meter, named once
and kept), a rank killed mid-epoch and the job resumed to the same parameters and the same
rolling-origin forecast, forecast.png and the forecast and seasonal naive metrics in
summary.json, and `dptrain predict` writing the forecast with its variances and origins
(issues 20 and 28; docs/design.md, contract 3)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

import dptrain
from tests._cli import dptrain_cmd, run

pytestmark = pytest.mark.e2e

SERIES, STEPS = ("north", "south", "east", "dead"), 160


def _long_csv(path: Path) -> Path:
    """Four daily series in long format (date, series, value), one value missing, the last
    a dead meter (zeros throughout)."""
    rng = np.random.default_rng(0)
    days = np.datetime64("2024-01-01") + np.arange(STEPS)
    rows = ["date,series,value"]
    for s, name in enumerate(SERIES):
        level, amplitude = 20.0 * (s + 1), 4.0 + s
        values = level + amplitude * np.sin(2 * np.pi * np.arange(STEPS) / 12 + s)
        values += rng.normal(0.0, 0.3, STEPS)
        if name == "dead":
            values = np.zeros(STEPS)
        rows += [f"{day},{name},{'' if (s, t) == (1, 40) else repr(float(v))}"
                 for t, (day, v) in enumerate(zip(days, values))]
    path.write_text("\n".join(rows) + "\n")
    return path


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_a_forecasting_run_resumes_bit_exactly_and_predict_writes_its_forecast(tmp_path):
    data = _long_csv(tmp_path / "regions.csv")
    # the registry's LSTM with its defaults (batch 16: 25 steps an epoch), the series id
    # embedded in 3 dimensions
    common = ["train", "--model", "tagi-lstm", "--dataset", f"series:{data}", "--lookback",
              "12", "--horizon", "2", "--epochs", "2", "--checkpoint-every", "10",
              "--series-embedding", "3", "--time-features", "weekday,month",
              "--forecast-every", "8", "--no-progress"]
    clean = run(dptrain_cmd(*common, "--out", str(tmp_path / "clean")), timeout_s=180)
    assert clean.returncode == 0, clean.output
    killed = run(dptrain_cmd(*common, "--out", str(tmp_path / "killed"), "--fail-at", "1:23",
                             "--max-restarts", "1"), timeout_s=240)
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.stdout and "step-00000020" in killed.stdout
    assert "; forecast of the test part: rmse " in clean.stdout, clean.stdout[-600:]
    done, again = _summary(tmp_path / "clean"), _summary(tmp_path / "killed")
    assert done["world_size"] == 2 and done["params_sha256"] == again["params_sha256"]
    forecast_keys = [k for k in done if k.startswith("forecast_")]
    metrics = ["rmse", "log_likelihood", "coverage_1sigma", "coverage_2sigma",
               "coverage_3sigma", "nd", "p90_loss", "mase", "mase_seasonal"]
    assert sorted(forecast_keys) == sorted(
        [f"forecast_{m}" for m in metrics] + [f"forecast_{m}_naive" for m in metrics]
        + ["forecast_every", "forecast_season", "forecast_naive_season",
           "forecast_variance_scale", "forecast_variance_scale_rule",
           "forecast_variance_scale_pooled"])
    assert done["forecast_season"] == 7  # daily dates: a week (and a year, too long here)
    assert done["forecast_every"] == 8
    assert "(seasonal naive " in clean.stdout
    # the dead meter is named once, and the run goes on with it
    assert clean.output.count("constant over their training part") == 1, clean.output
    assert "'dead' (0)" in clean.output
    assert all(done[k] == again[k] for k in forecast_keys)
    assert all(math.isfinite(done[k]) for k in forecast_keys
               if k != "forecast_variance_scale_rule")  # the rule is named, in words
    assert (tmp_path / "killed" / "epochs.csv").read_text() == \
        (tmp_path / "clean" / "epochs.csv").read_text()
    for key in ("test_rmse", "test_log_likelihood", "test_coverage_2sigma"):
        assert math.isfinite(done[key]), key
    assert (tmp_path / "clean" / "forecast.png").stat().st_size > 5000
    trained = dptrain.load_run(tmp_path / "clean").model.state_dict()
    assert trained["0.1.0.mu_w"].shape == (len(SERIES), 3)  # one row per series id
    # the head reads the LSTMs (12 steps of a value and 9 calendar covariates) and the
    # embedding, and gives a (mean, noise) pair for each of the 2 targets (heteroscedastic)
    assert trained["1.mu_w"].shape == (4, 8 * 12 + 3)

    out = tmp_path / "forecast.csv"
    predicted = run(dptrain_cmd("predict", str(tmp_path / "clean"), "--checkpoint", "last",
                                "--out", str(out)), timeout_s=120)
    assert predicted.returncode == 0, predicted.output
    with open(out) as f:
        rows = list(csv.DictReader(f))
    test_steps = STEPS - 128  # the test part: the last 20 % of 160 days
    assert len(rows) == len(SERIES) * test_steps
    assert [r["series"] for r in rows[::test_steps]] == list(SERIES)
    assert rows[0]["time"] == str(np.datetime64("2024-01-01") + 128)
    assert all(float(r["var"]) > 0 for r in rows)
    # rolling origins every 8 days, from the test part's first
    assert [r["origin"] for r in rows[:test_steps:8]] == [rows[k]["time"]
                                                        for k in range(0, test_steps, 8)]
    assert rows[9]["origin"] == rows[8]["time"]
    # the same forecast the run reported: its RMSE, from the file
    errors = [(float(r["mean"]) - float(r["observed"])) ** 2 for r in rows]
    assert math.sqrt(sum(errors) / len(errors)) == pytest.approx(done["forecast_rmse"],
                                                                  rel=1e-5)
