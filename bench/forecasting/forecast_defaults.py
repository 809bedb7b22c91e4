"""tagi-lstm at its registry defaults on the built-in series: ND beside the seasonal naive's and
the ±2σ coverage before and after the variance scale chosen on validation.

    .venv/bin/python bench/forecasting/forecast_defaults.py  # writes bench/results/forecast_defaults.json

Each row trains the registry's tagi-lstm (learned noise, --hidden 8, --batch-size 16, 10
epochs, seed 0) on one built-in series with the row's lookback, horizon, calendar features
and protocol (the whole test part, or rolled daily), as the learning tests in
tests/unit/forecasting/test_covariates.py do, and scores the test part's forecast as a run
reports it.
Printed: the rows of docs/tutorials/forecasting.md's calibration table, which
tests/unit/test_readme_figures.py checks against the result file.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model  # noqa: E402

from dptrain.data.config import DataConfig, load_split  # noqa: E402
from dptrain.data.loader import fetch_batch  # noqa: E402
from dptrain.runtime import Runtime  # noqa: E402
from dptrain.runtime.env import SINGLE  # noqa: E402
from dptrain.learners.build import create_learner, model_defaults, model_split  # noqa: E402
from dptrain.learners.config import LearnerConfig, ModelConfig  # noqa: E402
from dptrain.learners.forecast import (  # noqa: E402
    calibrated_test,
    forecast_metrics,
    forecast_report,
    forecast_test,
    naive_test,
)

ROWS = [  # dataset, lookback, horizon, forecast_every, time_features
    ("hourly", 48, 1, 0, "auto"), ("hourly", 24, 1, 0, "auto"),
    ("hourly", 48, 1, 24, "auto"), ("hourly", 48, 1, 24, ""),
    ("hourly", 24, 1, 24, "auto"), ("hourly", 24, 1, 24, ""),
    ("seasonal", 48, 1, 24, "auto"), ("seasonal", 48, 1, 0, "auto"),
    ("seasonal", 24, 1, 0, "auto"), ("seasonal", 24, 1, 0, ""),
    ("sine", 48, 1, 0, "auto"), ("sine", 24, 1, 0, "auto"), ("sine", 24, 1, 0, ""),
    ("sine", 96, 48, 0, "auto"),
]


def run(dataset: str, lookback: int, horizon: int, every: int, features: str, epochs: int,
        seed: int) -> dict:
    defaults = model_defaults("tagi-lstm")
    split = load_split(DataConfig(dataset=dataset, lookback=lookback, horizon=horizon,
                                  forecast_every=every, time_features=features), seed=seed)
    config = ModelConfig(model="tagi-lstm", hidden=defaults["hidden"],
                         heteroscedastic=defaults["heteroscedastic"])
    learner = create_learner(config, LearnerConfig(sigma_v=defaults["sigma_v"]), split,
                             seed=seed)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    gen, started = torch.Generator().manual_seed(seed), time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(split.train), generator=gen).split(defaults["batch_size"]):
            learner.train_step(split.train[idx])
    series = split.series
    forecast, scale = calibrated_test(learner.predict_moments, series)
    metrics = forecast_metrics(forecast, series)
    raw = forecast_metrics(forecast_test(learner.predict_moments, series), series)
    naive = forecast_metrics(naive_test(series)[0], series)
    return {"dataset": dataset, "lookback": lookback, "horizon": horizon,
            "forecast_every": every, "time_features": features, "test_steps":
            series.values.shape[1] - series.val_end, "variance_scale": scale,
            "coverage_2sigma_unscaled": raw["coverage_2sigma"],
            "coverage": [metrics[f"coverage_{k}sigma"] for k in (1, 2, 3)],
            "nd": metrics["nd"], "nd_naive": naive["nd"],
            "train_seconds": round(time.perf_counter() - started, 1)}


MULTI_SERIES = 30
"""Meters in the multi-series case: kept small for speed; the shape of the trouble is what
matters (issue 39)."""


def load_csv(path: Path, *, troubled: bool, num_series: int = MULTI_SERIES, seed: int = 0
             ) -> Path:
    """The generated load file (`dptrain.data.datasets.synthetic_series.write_load_csv`)."""
    from dptrain.data.datasets.synthetic_series import write_load_csv
    return write_load_csv(path, num_series=num_series, troubled=troubled, seed=seed)


def run_multi(troubled: bool, epochs: int, seed: int, scaling: str = "auto") -> dict:
    """tagi-lstm with an 8-wide series embedding on the generated load file (lookback 24,
    horizon 1, calendar features, rolled daily, batch 64, --window-scaling `scaling`), scored
    as a run reports it (the last epoch's model: summary.json) and as `dptrain predict` of
    best/ gives it (the epoch chosen on validation, by the default val_series_nrmse and by
    the pooled val_rmse)."""
    defaults = model_defaults("tagi-lstm")
    with tempfile.TemporaryDirectory() as tmp:
        path = load_csv(Path(tmp) / "load.csv", troubled=troubled, seed=seed)
        split = load_split(DataConfig(dataset=f"series:{path}", lookback=24, horizon=1,
                                      forecast_every=24, time_features="auto", val_size="24",
                                      test_size="168"), seed=seed)
    config = ModelConfig(model="tagi-lstm", hidden=defaults["hidden"],
                         heteroscedastic=defaults["heteroscedastic"], series_embedding=8,
                         window_scaling=scaling)
    split = model_split(config, split)
    learner = create_learner(config, LearnerConfig(sigma_v=defaults["sigma_v"]), split,
                             seed=seed)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    gen, started = torch.Generator().manual_seed(seed), time.perf_counter()
    best: dict[str, tuple[float, int, dict]] = {}  # monitor -> (value, epoch, state)
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(len(split.train), generator=gen).split(64):
            learner.train_step(split.train[idx])
        val = _validation(learner, split)
        for monitor in ("series_nrmse", "rmse"):
            if monitor not in best or val[monitor] < best[monitor][0]:
                best[monitor] = (val[monitor], epoch, copy.deepcopy(learner.state_dict()))
    train_seconds = round(time.perf_counter() - started, 1)
    report = forecast_report(learner.predict_moments, split.series, None)
    row = {"dataset": "load, troubled" if troubled else "load, clean", "lookback": 24,
           "horizon": 1, "forecast_every": 24, "series": MULTI_SERIES,
           "window_scaling_option": scaling,
           "window_scaling": "on" if learner.window_scaling is not None else "off",
           **_scores(report), **_meter_nd(learner, split.series, troubled),
           "train_seconds": train_seconds}
    for monitor, (value, epoch, state) in best.items():
        learner.load_state_dict(state)
        chosen = forecast_report(learner.predict_moments, split.series, None)
        row[f"best_by_val_{monitor}"] = {"epoch": epoch, f"val_{monitor}": value,
                                         **_scores(chosen)}
    return row


def _validation(learner, split) -> dict[str, float]:
    """The validation windows' metrics as the Trainer computes them: val_rmse and
    val_series_nrmse (dptrain.learners.series_metrics)."""
    batch = fetch_batch(split.validation, 0, torch.arange(len(split.validation)))
    sums = learner.eval_step(batch)
    means = learner.end_evaluation({k: s / c for k, (s, c) in sums.items() if c}, "val")
    return {"rmse": math.sqrt(means["mse"]), "series_nrmse": means["series_nrmse"]}


def _scores(report: dict) -> dict:
    return {"variance_scale": report["forecast_variance_scale"],
            "variance_scale_rule": report["forecast_variance_scale_rule"],
            "variance_scale_pooled": report["forecast_variance_scale_pooled"],
            "coverage_2sigma": report["forecast_coverage_2sigma"],
            "coverage_2sigma_naive": report["forecast_coverage_2sigma_naive"],
            "log_likelihood": report["forecast_log_likelihood"],
            "log_likelihood_naive": report["forecast_log_likelihood_naive"],
            "nd": report["forecast_nd"], "nd_naive": report["forecast_nd_naive"],
            "failed_series": report.get("forecast_failed_series", [])}


ODD_METERS = 3
"""Meters 0-2 of the troubled file: two that wake up, one that triples (write_load_csv)."""


def _meter_nd(learner, series, troubled: bool) -> dict:
    """The ND of the odd meters and of the others apart, ours and the seasonal naive's: where
    the troubled file's ND comes from."""
    forecast, _ = calibrated_test(learner.predict_moments, series)
    naive, _ = naive_test(series)
    out = {}
    for name, rows in (("odd", slice(0, ODD_METERS)), ("others", slice(ODD_METERS, None))):
        y = forecast.observed[rows]
        seen = torch.isfinite(y)
        scale = y[seen].abs().sum()
        for who, f in (("", forecast), ("_naive", naive)):
            err = (f.mean[rows] - y).abs()[seen].sum()
            out[f"nd_{name}_meters{who}"] = (err / scale).item()
    return out if troubled else {}


def multi_rows(r: dict) -> list[str]:
    """The rows of docs/results.md's multi-series table: the last epoch's model (what
    summary.json reports), then best/ as each monitor chooses it (what `dptrain predict`
    forecasts with)."""
    chosen = [(f"best/ by val_{m} (epoch {r[f'best_by_val_{m}']['epoch']})",
               r[f"best_by_val_{m}"]) for m in ("series_nrmse", "rmse")]
    scaling = f"window scaling {r['window_scaling']}" + (
        " (auto)" if r["window_scaling_option"] == "auto" else "")
    return [f"| {r['dataset']} ({r['series']} meters), {scaling}, {label} | "
            f"{c['variance_scale']:.2f} ({c['variance_scale_rule'].split(':')[0]}; pooled "
            f"{c['variance_scale_pooled']:.3g}) | {100 * c['coverage_2sigma']:.1f} % "
            f"({100 * c['coverage_2sigma_naive']:.1f} %) | {c['log_likelihood']:.2f} "
            f"({c['log_likelihood_naive']:.2f}) | {c['nd']:.3f} ({c['nd_naive']:.3f}) |"
            for label, c in [("last epoch", r), *chosen]]


def table_row(r: dict) -> str:
    """The row of docs/tutorials/forecasting.md's calibration table."""
    protocol = "rolled daily" if r["forecast_every"] else "whole test part"
    features = "" if r["time_features"] == "auto" else ', `--time-features ""`'
    scale = r["variance_scale"]
    return (f"| `{r['dataset']}`, L {r['lookback']}, H {r['horizon']}, {protocol}{features} | "
            f"{100 * r['coverage_2sigma_unscaled']:.1f} → {100 * r['coverage'][1]:.1f} % | "
            f"{scale:.2f} | {r['nd']:.3f} | {r['nd_naive']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--multi-series", action="store_true",
                        help="only the multi-series load case, clean and troubled "
                             "(bench/results/forecast_multi_series.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.multi_series:
        # auto on each file, and the troubled one as it forecast before window scaling
        multi = [run_multi(troubled, args.epochs, args.seed, scaling) for troubled, scaling
                 in ((False, "auto"), (True, "auto"), (True, "off"))]
        for r in multi:
            print("\n".join(multi_rows(r)), flush=True)
            if "nd_odd_meters" in r:
                print(f"  ND of meters 0-2: {r['nd_odd_meters']:.3f} (naive "
                      f"{r['nd_odd_meters_naive']:.3f}); of the others: "
                      f"{r['nd_others_meters']:.3f} (naive {r['nd_others_meters_naive']:.3f})")
        if not args.no_write:
            out = RESULTS / "forecast_multi_series.json"
            out.write_text(json.dumps({"command": command_line(), "cpu": cpu_model(),
                                       "torch": torch.__version__, "epochs": args.epochs,
                                       "seed": args.seed, "results": multi}, indent=1) + "\n")
            print(f"-> {out}")
        return
    results = []
    for row in ROWS:
        results.append(run(*row, epochs=args.epochs, seed=args.seed))
        print(table_row(results[-1]), flush=True)
    if not args.no_write:
        record = {"command": command_line(), "cpu": cpu_model(), "python":
                  platform.python_version(), "torch": torch.__version__, "epochs": args.epochs,
                  "seed": args.seed, "results": results}
        out = RESULTS / "forecast_defaults.json"
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"-> {out}")


if __name__ == "__main__":
    main()
