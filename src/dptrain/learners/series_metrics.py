"""A validation measure of multi-series windows that one odd series cannot capture.

    metrics.update(series_sums(err2, seen, batch.series))   # eval_step: (sum, count) per series
    means = pop_series_nrmse(means, part)                    # end_evaluation: series_nrmse

Each series' squared errors (standardised units: its own training std) are summed as metrics
are, `(sum, count)` per series, so the reduction over the ranks stays exact however the
windows are shared out (docs/design.md, contract 5). `series_nrmse` is then the mean over
the series of each one's RMSE in its own standard units, each counted at most
`ODD_SERIES_BOUND` (4) times their median, as the forecast's variance scale counts each
series': scale-free, and balanced over the series. The pooled
`rmse` beside it weighs each window alike, so one series whose validation values leave its
training range (a level shift, a meter that wakes up) sets it, and with it the epoch chosen;
in `series_nrmse` such a series moves the measure of S series by at most 3/S of the typical
series' RMSE (docs/tutorials/forecasting.md).

A learner with predictive variances (TAGI) also gives each target's place inside or outside
its ±2σ interval (`inside`): `series_coverage_2sigma` is the mean over the series of each
one's coverage, where the pooled `coverage_2sigma` is that of the series with the most
windows, and a series whose intervals miss every value counts as one series, not by its
share of the windows.
"""

from __future__ import annotations

import math

import torch

from dptrain.learners.forecast import ODD_SERIES_BOUND
from dptrain.learners.protocol import Metrics

PREFIX = "_series_mse:"
"""Per-series sums for `pop_series_nrmse` alone (the leading "_": not shown, not a column)."""
COVERAGE_PREFIX = "_series_cov2:"
"""Per-series counts of targets inside their ±2σ interval, for `pop_series_nrmse`."""


def series_sums(err2: torch.Tensor, seen: torch.Tensor, series: torch.Tensor | None,
                prefix: str = "", inside: torch.Tensor | None = None) -> Metrics:
    """(sum of squared errors, observed targets) per series of a batch: err2 and seen (B, H),
    series (B,) (`Batch.series`; None: one series or none, nothing to add); with `inside`
    (B, H), whether each observed target lies in its ±2σ interval, (inside, observed) too."""
    if series is None or not len(series):
        return {}
    ids, row = series.cpu().unique(return_inverse=True)

    def per_series(values: torch.Tensor) -> list[float]:
        return torch.zeros(len(ids), dtype=torch.float64).index_add_(
            0, row, values.detach().double().cpu().reshape(len(series), -1).sum(1)).tolist()

    count = per_series(seen)
    sums = [(PREFIX, per_series(err2))]
    if inside is not None:
        sums.append((COVERAGE_PREFIX, per_series(inside & seen)))
    return {f"{prefix}{kind}{s}": (total, c) for kind, totals in sums
            for s, total, c in zip(ids.tolist(), totals, count) if c > 0}


def pop_series_nrmse(means: dict[str, float], part: str, prefix: str = "") -> dict[str, float]:
    """`means` without the per-series entries of `series_sums` (made with `prefix`), and,
    for the validation part ("val") where there were any, with `{prefix}series_nrmse` from
    them (module docstring), and `{prefix}series_coverage_2sigma` where they held coverage.
    They are there to choose: the test part reports the pooled metrics alone, as it did
    before (a run from before them resumes with the columns it began with)."""
    covered = [name for name in means if name.startswith(f"{prefix}{COVERAGE_PREFIX}")]
    coverage = [means.pop(name) for name in covered]
    if coverage and part == "val":
        means[f"{prefix}series_coverage_2sigma"] = sum(coverage) / len(coverage)
    names = [name for name in means if name.startswith(f"{prefix}{PREFIX}")]
    if not names or part != "val":
        for name in names:
            del means[name]
        return means
    rmse = torch.tensor([math.sqrt(means.pop(name)) for name in names], dtype=torch.float64)
    rmse = rmse[torch.isfinite(rmse)]
    if len(rmse):
        means[f"{prefix}series_nrmse"] = \
            rmse.clamp_max(ODD_SERIES_BOUND * rmse.median()).mean().item()
    else:
        means[f"{prefix}series_nrmse"] = math.nan
    return means
