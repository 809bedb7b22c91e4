"""`dptrain predict RUN_DIR`: the predictions of a trained run on a dataset, as a CSV table."""

from __future__ import annotations

import argparse

from dptrain.inference import load_run, write_predictions


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predict", help="predict with a trained run (one process), write a CSV",
        description="Load the best (or last) checkpoint of a dptrain train run and write one "
                    "row per test sample: class probabilities (TAGI: with their variance), or "
                    "regression mean and variance in the data's units.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--data", metavar="DATASET",
                   help="a dataset spelling as for dptrain train --dataset (default: the run's "
                        "own); its test part is predicted")
    p.add_argument("--part", choices=("test", "train"), default="test")
    p.add_argument("--checkpoint", choices=("best", "last"), default="best")
    p.add_argument("--out", metavar="FILE.csv", default="predictions.csv")
    p.set_defaults(func=predict_command)


def predict_command(args: argparse.Namespace) -> int:
    run = load_run(args.run_dir, which=args.checkpoint)
    split = run.load_data(args.data)
    prediction = run.predict_split(split, args.part)
    write_predictions(args.out, prediction, run.task)
    shown = ""
    if prediction.targets is not None and run.task == "classification":
        error = (prediction.labels != prediction.targets).float().mean().item()
        shown = f", error {100 * error:.2f} %"
    elif prediction.targets is not None:
        rmse = ((prediction.mean - prediction.targets) ** 2).mean().sqrt().item()
        shown = f", rmse {rmse:.4g}"
    print(f"dptrain predict: {len(prediction.mean)} {args.part} samples of "
          f"{args.data or run.dataset} with {run.checkpoint}{shown} -> {args.out}")
    return 0
