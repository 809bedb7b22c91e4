"""What the regression benchmarks against pytagi share: Gaussian predictions scored in the data's
units, and the per-library summary over seeds (pytagi/tagi_heteros_vs_pytagi.py,
pytagi/tagi_lstm_vs_pytagi.py)."""

from __future__ import annotations

import math
import statistics

import numpy as np


def gaussian_scores(y: np.ndarray, mean: np.ndarray, var: np.ndarray) -> dict[str, float]:
    """RMSE, mean log-likelihood per point and the share within 2σ of predictive N(mean, var)."""
    err2 = (y - mean) ** 2
    return {"rmse": float(np.sqrt(err2.mean())),
            "log_likelihood": float(np.mean(-0.5 * (math.log(2 * math.pi) + np.log(var)
                                                    + err2 / var))),
            "coverage_2sigma": float(np.mean(np.sqrt(err2 / var) <= 2))}


def summarize(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per library: the mean over seeds of each score, the median of samples/s (wall clock,
    and per CPU second where recorded: timings on a shared machine have outliers; scores do
    not)."""
    return {name: {key: (statistics.median if key.endswith("samples_per_s") else
                         statistics.mean)(
                       [r[key] for r in runs]) for key in runs[0]}
            for name, runs in rows.items()}


def print_table(summary: dict[str, dict[str, float]]) -> None:
    print(f"{'':8} {'test RMSE':>9} {'log-lik':>8} {'2σ cover':>8} {'train samples/s':>16}")
    for name, s in summary.items():
        print(f"{name:8} {s['rmse']:9.4f} {s['log_likelihood']:8.4f} "
              f"{100 * s['coverage_2sigma']:7.1f}% {s['samples_per_s']:16.0f}")
