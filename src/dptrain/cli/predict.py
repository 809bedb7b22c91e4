"""`dptrain predict RUN_DIR`: the predictions of a trained run on a dataset, as a CSV table."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dptrain.errors import ConfigError
from dptrain.inference import TrainedRun, load_run, write_forecast, write_predictions


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predict", help="predict with a trained run (one process), write a CSV",
        description="Load the best (or last) checkpoint of a dptrain train run and write one "
                    "row per test sample: class probabilities (TAGI: with their variance), or "
                    "regression mean and variance in the data's units; for a time series "
                    "the forecast of its test part, one row per series and time step.")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory, or a file written by dptrain export (.pt2, .onnx)")
    p.add_argument("--data", metavar="DATASET",
                   help="a dataset spelling as for dptrain train --dataset (default: the run's "
                        "own, read again); its test part is predicted (a time series' and "
                        "token data with the run's own options: lookback, protocol, block size)")
    p.add_argument("--part", choices=("test", "train"), default="test",
                   help="which part of the data to predict (default: test)")
    p.add_argument("--checkpoint", choices=("best", "last"), default="best",
                   help="best: the checkpoint validation chose; last: the newest (default: best)")
    p.add_argument("--out", metavar="FILE.csv", default="predictions.csv",
                   help="the CSV to write (default: predictions.csv)")
    p.set_defaults(func=predict_command)


def predict_command(args: argparse.Namespace) -> int:
    if args.run_dir.endswith((".pt2", ".onnx")):
        return exported_command(args)
    run = load_run(args.run_dir, which=args.checkpoint)
    for note in run.notes:
        print(f"dptrain predict: {note}", file=sys.stderr)
    if run.vocabulary is not None:
        raise ConfigError(f"{args.run_dir}: {run.model_config.model} is a language model, which "
                          f"predicts a token at every position, more than predict's one row "
                          f"per sample holds: use dptrain generate (text) or dptrain export "
                          f"(the probabilities)")
    split = run.load_data(args.data)
    # a torch model gives no variance to feed back: its windows are predicted one by one
    if split.series is not None and run.kind == "tagi" and args.part == "test":
        return forecast_command(run, split, args.out, args.data)
    prediction = run.predict_split(split, args.part)
    write_predictions(args.out, prediction, run.task)
    print(f"dptrain predict: {len(prediction.mean)} {args.part} samples of "
          f"{args.data or run.dataset} with {run.checkpoint}{shown(prediction, run.task)} -> "
          f"{args.out}")
    return 0


def exported_command(args: argparse.Namespace) -> int:
    """An exported model (dptrain export): the same table as for its run."""
    from dptrain.export import predict_exported

    prediction, meta = predict_exported(args.run_dir, args.data, args.part)
    write_predictions(args.out, prediction, meta["task"])
    print(f"dptrain predict: {len(prediction.mean)} {args.part} samples of "
          f"{args.data or meta['dataset']} with {args.run_dir}"
          f"{shown(prediction, meta['task'])} -> {args.out}")
    return 0


def shown(prediction: Any, task: str) -> str:
    """", error 3.10 %" or ", rmse 0.52" where the data had targets."""
    if prediction.targets is not None and task == "classification":
        error = (prediction.labels != prediction.targets).float().mean().item()
        return f", error {100 * error:.2f} %"
    if prediction.targets is not None:
        rmse = ((prediction.mean - prediction.targets) ** 2).mean().sqrt().item()
        return f", rmse {rmse:.4g}"
    return ""


def forecast_command(run: TrainedRun, split: Any, out: str, data: str | None) -> int:
    """A time-series run: the recursive forecast of its test part, one row per series and
    time step."""
    series = split.series
    forecast = run.forecast(split)
    write_forecast(out, forecast, series)
    seen = forecast.observed == forecast.observed  # not NaN
    rmse = ((forecast.mean - forecast.observed)[seen] ** 2).mean().sqrt().item()
    print(f"dptrain predict: forecast of {forecast.mean.shape[1]} test step(s) of "
          f"{len(series.names)} series of {data or run.dataset} with {run.checkpoint}, rmse "
          f"{rmse:.4g} -> {out}")
    return 0
