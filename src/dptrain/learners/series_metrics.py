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
series' RMSE (docs/forecasting.md).
"""

from __future__ import annotations

import math

import torch

from dptrain.learners.forecast import ODD_SERIES_BOUND
from dptrain.learners.protocol import Metrics

PREFIX = "_series_mse:"
"""Per-series sums for `pop_series_nrmse` alone (the leading "_": not shown, not a column)."""


def series_sums(err2: torch.Tensor, seen: torch.Tensor, series: torch.Tensor | None,
                prefix: str = "") -> Metrics:
    """(sum of squared errors, observed targets) per series of a batch: err2 and seen (B, H),
    series (B,) (`Batch.series`; None: one series or none, nothing to add)."""
    if series is None or not len(series):
        return {}
    ids, row = series.cpu().unique(return_inverse=True)
    err2_sum = torch.zeros(len(ids), dtype=torch.float64).index_add_(
        0, row, err2.detach().double().cpu().reshape(len(series), -1).sum(1))
    count = torch.zeros(len(ids), dtype=torch.float64).index_add_(
        0, row, seen.cpu().reshape(len(series), -1).sum(1).double())
    return {f"{prefix}{PREFIX}{s}": (e, c)
            for s, e, c in zip(ids.tolist(), err2_sum.tolist(), count.tolist()) if c > 0}


def pop_series_nrmse(means: dict[str, float], part: str, prefix: str = "") -> dict[str, float]:
    """`means` without the per-series entries of `series_sums` (made with `prefix`), and,
    for the validation part ("val") where there were any, with `{prefix}series_nrmse` from
    them (module docstring). It is there to choose: the test part reports the pooled metrics
    alone, as it did before (a run from before it resumes with the columns it began with)."""
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
