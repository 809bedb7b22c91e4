"""Multi-step forecasts of a series' test part, their metrics and their plot.

    from dptrain.learners.forecast import forecast_test, forecast_metrics

    forecast = forecast_test(learner.predict_moments, split.series)   # data units
    forecast_metrics(forecast, split.series)     # {"rmse": ..., "nd": ..., "mase": ...}

A forecast starts from the last `lookback` values observed before the test part and runs to
its end recursively: each step predicts the next `horizon` values (mean and variance, the
observation noise included) and feeds them back as inputs, the variances as input variances,
so the uncertainty of what was predicted carries into what is predicted from it. A model that
takes series ids (`SeriesData.with_ids`) gets each series' id after its values at every step,
with variance 0: the id is known, never predicted, never fed back.
Definitions of the metrics: docs/forecasting.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dptrain.data.datasets.series import SeriesData, forward_fill
from dptrain.learners.plots import pyplot

PredictMoments = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(input means, input variances), each (B, lookback) in standardised units (lookback + 1
with the series id last, for a model that takes it) -> (mean, predictive variance of the
observations), each (B, horizon)."""

Z_90 = 1.2815515655446004
"""The standard normal's 0.9 quantile."""


@dataclass(frozen=True, eq=False)
class Forecast:
    """Mean and variance (S, n) of the test part's n values, in the data's units, with the
    observed values (NaN where missing); the first forecast value is time step `start`."""

    mean: torch.Tensor
    var: torch.Tensor
    observed: torch.Tensor
    start: int


@torch.no_grad()
def recursive_forecast(predict: PredictMoments, series: SeriesData, start: int, steps: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance), each (S, steps), standardised, of the `steps` values from time step
    `start` on, from the values observed before it (missing ones filled as for inputs)."""
    lookback, horizon = series.lookback, series.horizon
    context = forward_fill(series.normalised[:, :start])[:, -lookback:].float()  # (S, L)
    context_var = torch.zeros_like(context)
    ids = torch.arange(len(context), dtype=context.dtype)[:, None]  # (S, 1)
    means, variances = [], []
    for _ in range(math.ceil(steps / horizon)):
        if series.with_ids:  # known exactly: variance 0, and never fed back
            mean, var = predict(torch.cat([context, ids], 1),
                                torch.cat([context_var, torch.zeros_like(ids)], 1))
        else:
            mean, var = predict(context, context_var)
        mean, var = mean.float().cpu(), var.float().cpu()
        means.append(mean)
        variances.append(var)
        context = torch.cat([context, mean], 1)[:, -lookback:]
        context_var = torch.cat([context_var, var], 1)[:, -lookback:]
    return torch.cat(means, 1)[:, :steps], torch.cat(variances, 1)[:, :steps]


def forecast_test(predict: PredictMoments, series: SeriesData) -> Forecast:
    """The forecast of the whole test part, from the values observed before it."""
    start, steps = series.val_end, series.values.shape[1] - series.val_end
    mean, var = recursive_forecast(predict, series, start, steps)
    mean_d, std_d = series.norm.mean.float(), series.norm.std.float()  # (S, 1)
    return Forecast(mean * std_d + mean_d, var * std_d ** 2,
                    series.values[:, start:].float(), start)


def forecast_metrics(forecast: Forecast, series: SeriesData) -> dict[str, float]:
    """rmse, log_likelihood, coverage_2sigma, nd, p90_loss and mase over the observed values
    of the forecast (docs/forecasting.md)."""
    y, m, v = forecast.observed.double(), forecast.mean.double(), forecast.var.double()
    seen = torch.isfinite(y)
    y0 = torch.where(seen, y, 0.0)
    abs_err = torch.where(seen, (y0 - m).abs(), 0.0)
    count = seen.sum().item()
    log_lik = -0.5 * (math.log(2 * math.pi) + v.log() + (y0 - m) ** 2 / v)
    q90 = m + Z_90 * v.sqrt()
    pinball = torch.where(y0 >= q90, 0.9 * (y0 - q90), 0.1 * (q90 - y0))
    scale = y0.abs().sum().item()
    return {
        "rmse": math.sqrt((abs_err ** 2).sum().item() / count),
        "log_likelihood": torch.where(seen, log_lik, 0.0).sum().item() / count,
        "coverage_2sigma": (seen & (abs_err <= 2 * v.sqrt())).sum().item() / count,
        "nd": abs_err.sum().item() / scale if scale > 0 else math.nan,
        "p90_loss": 2 * torch.where(seen, pinball, 0.0).sum().item() / scale
        if scale > 0 else math.nan,
        "mase": _mase(abs_err, seen, series),
    }


def _mase(abs_err: torch.Tensor, seen: torch.Tensor, series: SeriesData) -> float:
    """Mean over the series of the forecast's mean absolute error divided by the mean absolute
    change between consecutive observed training values (the one-step naive forecast's
    error in sample)."""
    train = series.values[:, :series.train_end].double()
    change = (train[:, 1:] - train[:, :-1]).abs()
    ratios = []
    for s in range(train.shape[0]):
        naive = change[s][torch.isfinite(change[s])]
        observed = seen[s].sum()
        if len(naive) and naive.mean() > 0 and observed:
            ratios.append((abs_err[s].sum() / observed / naive.mean()).item())
    return sum(ratios) / len(ratios) if ratios else math.nan


def forecast_report(predict: PredictMoments, series: SeriesData, out_dir: Path | None
                    ) -> dict[str, float]:
    """The forecast's metrics as `forecast_*` entries of summary.json; with `out_dir` (rank 0)
    also forecast.png."""
    forecast = forecast_test(predict, series)
    if out_dir is not None:
        plot_forecast(out_dir / "forecast.png", series, forecast)
    return {f"forecast_{k}": v for k, v in forecast_metrics(forecast, series).items()}


MAX_PANELS = 4


def plot_forecast(path: Path, series: SeriesData, forecast: Forecast) -> bool:
    """The observed series (up to `MAX_PANELS` of them), the forecast mean and its ±2σ band
    over the test part, the split points as dashed lines."""
    plt = pyplot()
    if plt is None:
        return False
    shown = min(MAX_PANELS, len(series.names))
    fig, axes = plt.subplots(shown, 1, figsize=(9, 2.6 * shown), squeeze=False)
    steps = torch.arange(series.values.shape[1])
    ahead = steps[forecast.start:]
    for s, ax in enumerate(axes[:, 0]):
        m, sd = forecast.mean[s], forecast.var[s].sqrt()
        ax.plot(steps, series.values[s], color="0.35", lw=0.6, label="observed")
        ax.fill_between(ahead, m - 2 * sd, m + 2 * sd, color="C0", alpha=0.3, label="±2σ")
        ax.plot(ahead, m, color="C3", lw=1.2, zorder=3, label="forecast mean")
        for split_at in (series.train_end, series.val_end):
            ax.axvline(split_at, color="grey", ls="--", lw=0.8)
        ax.set_title(series.names[s], fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel(f"time step (train | validation | test; {series.times[0]} to "
                           f"{series.times[-1]})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
