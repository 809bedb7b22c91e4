"""The TAGI-LSTM paper's forecasting protocol, run by dptrain, beside the seasonal naive forecast.

    .venv/bin/python bench/forecasting/forecast_protocol.py  # writes bench/results/forecast_protocol.json
    .venv/bin/python bench/forecasting/forecast_protocol.py --epochs 3 --no-write  # a quick look

Protocol (Vuong, Nguyen & Goulet, IJF 2025): calendar covariates (hour of the day, day of the
week), the epoch picked by the log-likelihood of the validation part's forecast (never the
test part's), and the test part forecast one day at a time from rolled origins (24 steps for
hourly values, 48 for half-hourly), each day's values revealed before the next. Data: the
generated `hourly` series (dptrain's built-in: six series, daily and weekly seasonality,
noise levels of their own, missing values), and when pmdarima is installed its half-hourly
electricity demand `load_taylor` (England and Wales, June-August 2000; Taylor 2003), a real
series no one here made. Printed and written: ND, p90 loss, RMSE, MASE, seasonal MASE and
the 1/2/3σ coverage of the model and of the seasonal naive forecast of the same protocol.

The paper's model predicts one step and is fed its own predictions for the rest of the day.
On load_taylor that loses to last week's values; so the real series is also forecast by a
day-ahead model, as a forecaster would try next: `--horizon 48` (the day predicted by one
model call, nothing fed back) from `--lookback 96` (two days), under the same protocol.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model  # noqa: E402

from dptrain.data.config import with_protocol  # noqa: E402
from dptrain.data.datasets.covariates import parse_feature_list, time_features  # noqa: E402
from dptrain.data.datasets.covariates import with_covariates  # noqa: E402
from dptrain.data.datasets.series import series_split  # noqa: E402
from dptrain.data.datasets.synthetic_series import load_hourly  # noqa: E402
from dptrain.runtime import Runtime  # noqa: E402
from dptrain.runtime.env import SINGLE  # noqa: E402
from dptrain.learners.build import create_learner, model_defaults  # noqa: E402
from dptrain.learners.config import LearnerConfig, ModelConfig  # noqa: E402
from dptrain.learners.forecast import calibrated_test, forecast_metrics, forecast_part  # noqa: E402
from dptrain.learners.forecast import naive_test  # noqa: E402

SHOWN = ("nd", "p90_loss", "rmse", "mase", "mase_seasonal", "coverage_1sigma",
         "coverage_2sigma", "coverage_3sigma", "log_likelihood")


def taylor(lookback: int, horizon: int = 1):
    """pmdarima's load_taylor: 4032 half-hourly values from Monday 5 June 2000, or None."""
    try:
        from pmdarima.datasets import load_taylor
    except ImportError:
        return None
    values = np.asarray(load_taylor(), dtype=np.float64)[None]
    start = np.datetime64("2000-06-05T00:00")
    times = [str(start + np.timedelta64(30 * k, "m")) for k in range(values.shape[1])]
    # the paper's split shape: most of it to train, a week to validate, two weeks to test
    return series_split("taylor", ["demand"], times, values, lookback=lookback, horizon=horizon,
                        train_fraction=0.75, val_fraction=1 / 12)


def run(split, every: int, epochs: int, seed: int) -> dict:
    """Train with the registry's tagi-lstm, pick the epoch on validation, score the test."""
    names = parse_feature_list("auto", split.series.times, split.name)
    split = with_protocol(with_covariates(split, *time_features(split.series.times, names)),
                          forecast_every=every)
    defaults = model_defaults("tagi-lstm")
    config = ModelConfig(model="tagi-lstm", hidden=defaults["hidden"],
                         heteroscedastic=defaults["heteroscedastic"])
    learner = create_learner(config, LearnerConfig(), split, seed=seed)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    series, gen = split.series, torch.Generator().manual_seed(seed)
    best, started = (-np.inf, 0, None), time.perf_counter()
    for epoch in range(epochs):
        learner.set_epoch(epoch)
        for idx in torch.randperm(len(split.train), generator=gen).split(
                defaults["batch_size"]):
            learner.train_step(split.train[idx])
        val = forecast_metrics(forecast_part(learner.predict_moments, series, series.train_end,
                                             series.val_end), series)
        if val["log_likelihood"] > best[0]:
            best = (val["log_likelihood"], epoch + 1, copy.deepcopy(learner.state_dict()))
    learner.load_state_dict(best[2])
    forecast, scale = calibrated_test(learner.predict_moments, series)
    model = forecast_metrics(forecast, series)
    naive, season = naive_test(series)
    return {"series": len(series.names), "time_steps": series.values.shape[1],
            "lookback": series.lookback, "horizon": series.horizon,
            "covariates": names, "forecast_every": every, "epochs": epochs,
            "chosen_epoch": best[1], "naive_season": season, "variance_scale": scale,
            "train_seconds": round(time.perf_counter() - started, 1),
            "model": {k: model[k] for k in SHOWN},
            "seasonal_naive": {k: forecast_metrics(naive, series)[k] for k in SHOWN}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"hourly": run(load_hourly(lookback=24), 24, args.epochs, args.seed)}
    real = taylor(lookback=48)
    if real is None:
        print("pmdarima is not installed: load_taylor left out (pip install pmdarima)")
    else:
        results["taylor"] = run(real, 48, args.epochs, args.seed)
        results["taylor_day_ahead"] = run(taylor(lookback=96, horizon=48), 48, args.epochs,
                                          args.seed)
    for name, r in results.items():
        print(f"{name}: {r['series']} series, lookback {r['lookback']}, horizon "
              f"{r['horizon']}, rolled every {r['forecast_every']} steps, "
              f"epoch {r['chosen_epoch']} of {r['epochs']} chosen on validation, naive season "
              f"{r['naive_season']}")
        for key in SHOWN:
            print(f"  {key:16} {r['model'][key]:8.4f}   seasonal naive "
                  f"{r['seasonal_naive'][key]:8.4f}")
    if not args.no_write:
        record = {"command": command_line(), "cpu": cpu_model(), "python":
                  platform.python_version(), "torch": torch.__version__, "results": results}
        out = RESULTS / "forecast_protocol.json"
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"-> {out}")


if __name__ == "__main__":
    main()
