"""Multi-step forecasts of a series' test part, their metrics and their plot.

    from dptrain.learners.forecast import forecast_test, forecast_metrics

    forecast = forecast_test(learner.predict_moments, split.series)   # data units
    forecast_metrics(forecast, split.series)     # {"rmse": ..., "nd": ..., "mase": ...}
    naive, season = naive_test(split.series)     # the seasonal naive baseline, same protocol

A forecast starts from the last `lookback` values observed before the test part and runs to
its end recursively: each step predicts the next `horizon` values (mean and variance, the
observation noise included) and feeds them back as inputs, the variances as input variances,
so the uncertainty of what was predicted carries into what is predicted from it. A model that
takes series ids (`SeriesData.with_ids`) gets each series' id after its values at every step,
with variance 0: the id is known, never predicted, never fed back. With rolling origins
(`SeriesData.forecast_every` K) a forecast of K steps starts every K steps of the test part,
each from the values observed before its origin. The seasonal naive forecast of the same
protocol is the baseline every forecast is reported beside.
Definitions of the metrics: docs/tutorials/forecasting.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain.data.datasets.series import SeriesData, forward_fill
from dptrain.learners.plots import pyplot
from dptrain.runtime.collectives import get_rank

log = logging.getLogger(__name__)

PredictMoments = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(input means, input variances), each (B, lookback) in standardised units (lookback + 1
with the series id last, for a model that takes it) -> (mean, predictive variance of the
observations), each (B, horizon)."""

FED_BACK_VARIANCE = 1.0
"""The largest input variance a recursive forecast feeds back, standardised: the series' own
training variance (see _recursive)."""

Z_90 = 1.2815515655446004
"""The standard normal's 0.9 quantile."""


@dataclass(frozen=True, eq=False)
class Forecast:
    """Mean and variance (S, n) of the test part's n values, in the data's units, with the
    observed values (NaN where missing); the first forecast value is time step `start`, and
    the value at step `start + k` was forecast from the values observed before `origin[k]`
    ((n,) int64: all `start` for one forecast of the whole part, rolling otherwise)."""

    mean: torch.Tensor
    var: torch.Tensor
    observed: torch.Tensor
    start: int
    origin: torch.Tensor | None = None

    @property
    def origins(self) -> torch.Tensor:
        return self.origin if self.origin is not None else \
            torch.full((self.mean.shape[1],), self.start, dtype=torch.int64)


def protocol(start: int, end: int, every: int) -> list[tuple[int, int]]:
    """(origin, steps) of each forecast covering time steps [start, end): one from `start`
    (every = 0), or one every `every` steps, each revealing its values before the next."""
    if every <= 0:
        return [(start, end - start)]
    return [(o, min(every, end - o)) for o in range(start, end, every)]


@torch.no_grad()
def recursive_forecast(predict: PredictMoments, series: SeriesData, start: int, steps: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance), each (S, steps), standardised, of the `steps` values from time step
    `start` on, from the values observed before it (missing ones filled as for inputs)."""
    mean, var = _recursive(predict, series, [start], steps)
    return mean[0], var[0]


def _recursive(predict: PredictMoments, series: SeriesData, starts: list[int], steps: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, S, steps) means and variances of the forecasts from each of the R `starts`, all
    R·S of them in one batch per model call."""
    lookback, horizon = series.lookback, series.horizon
    filled = forward_fill(series.normalised).float()  # a value at t only reads [0, t]
    context = torch.cat([filled[:, o - lookback:o] for o in starts])  # (R·S, L)
    context_var = torch.zeros_like(context)
    num_series = filled.shape[0]
    ids = torch.arange(num_series, dtype=context.dtype).repeat(len(starts))[:, None]
    origin = torch.tensor(starts).repeat_interleave(num_series)  # (R·S,)
    means, variances = [], []
    broken = torch.zeros(context.shape[0], dtype=torch.bool)
    for r in range(math.ceil(steps / horizon)):
        mu_x, var_x = _with_known(series, context, context_var, origin + r * horizon)
        if series.with_ids:  # known exactly: variance 0, and never fed back
            mu_x, var_x = torch.cat([mu_x, ids], 1), torch.cat([var_x, torch.zeros_like(ids)], 1)
        mean, var = predict(mu_x, var_x)
        mean, var = mean.float().cpu(), var.float().cpu()
        # A forecast that overflowed is that series' alone: NaN from here on (named by
        # forecast_report), and the batch goes on with a neutral value in its place.
        broken |= ~(torch.isfinite(mean) & torch.isfinite(var)).all(1)
        mean = torch.where(broken[:, None], 0.0, mean)
        var = torch.where(broken[:, None], 1.0, var)
        means.append(torch.where(broken[:, None], math.nan, mean))
        variances.append(torch.where(broken[:, None], math.nan, var))
        context = torch.cat([context, mean], 1)[:, -lookback:]
        # What is fed back is at most the series' own variance, 1 in standardised units: a
        # forecast can be no less certain than the series' training distribution, whose
        # spread no input of the training data exceeded. Without the bound the variance
        # loops back through the network and its learned noise (exp of a Gaussian, whose
        # mean grows as e^(var/2)) with a gain above 1 once it is past that spread, and
        # grows geometrically to inf within a lookback (docs/tutorials/forecasting.md). The output's
        # own variance is reported as it is.
        context_var = torch.cat([context_var, var.clamp_max(FED_BACK_VARIANCE)], 1)[:, -lookback:]
    shape = (len(starts), num_series, -1)
    return (torch.cat(means, 1)[:, :steps].reshape(shape),
            torch.cat(variances, 1)[:, :steps].reshape(shape))


def _with_known(series: SeriesData, context: torch.Tensor, context_var: torch.Tensor,
                ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (B, L) whose windows end before time steps `ends` (B,), with each step's known
    covariates of the time `horizon` steps on (as `WindowDataset` pairs them), variance 0:
    the data's own values over the whole horizon, never predictions."""
    if series.covariates is None:
        return context, context_var
    lookback, horizon = context.shape[1], series.horizon
    rows = ends[:, None] - lookback + horizon + torch.arange(lookback)  # (B, L)
    # steps past the data's end (a last call's rest of H, an origin's beyond the next one's
    # in the batched rolling forecast) are cut from the forecast: any covariate will do there
    cov = series.covariates[rows.clamp_max(len(series.covariates) - 1)]  # (B, L, C)
    mu_x = torch.cat([context[..., None], cov], -1).flatten(1)
    var_x = torch.cat([context_var[..., None], torch.zeros_like(cov)], -1).flatten(1)
    return mu_x, var_x


def _assemble(series: SeriesData, plan: list[tuple[int, int]], mean: torch.Tensor,
              var: torch.Tensor, standardised: bool) -> Forecast:
    """One Forecast of the time steps `plan` covers, from (R, S, >= steps) per origin."""
    mean = torch.cat([mean[r, :, :steps] for r, (_, steps) in enumerate(plan)], 1)
    var = torch.cat([var[r, :, :steps] for r, (_, steps) in enumerate(plan)], 1)
    if standardised:
        mean_d, std_d = series.norm.mean.float(), series.norm.std.float()  # (S, 1)
        mean, var = mean * std_d + mean_d, var * std_d ** 2
    start, end = plan[0][0], plan[-1][0] + plan[-1][1]
    origin = torch.cat([torch.full((steps,), o, dtype=torch.int64) for o, steps in plan])
    return Forecast(mean, var, series.values[:, start:end].float(), start, origin)


def forecast_part(predict: PredictMoments, series: SeriesData, start: int, end: int
                  ) -> Forecast:
    """The model's forecast of time steps [start, end) under the series' protocol
    (`forecast_every`)."""
    plan = protocol(start, end, series.forecast_every)
    mean, var = _recursive(predict, series, [o for o, _ in plan], max(s for _, s in plan))
    return _assemble(series, plan, mean, var, standardised=True)


def forecast_test(predict: PredictMoments, series: SeriesData) -> Forecast:
    """The forecast of the test part under the series' protocol: one recursive forecast from
    the values observed before it, or rolling origins (`forecast_every`)."""
    return forecast_part(predict, series, series.val_end, series.values.shape[1])


MIN_SCALE_VALUES = 48
"""Observed validation values a series needs to vote on the variance scale (two days of an
hourly series): fewer, at the lead times of a recursive forecast, are too few and too
correlated to estimate its spread."""

ODD_SERIES_BOUND = 4.0
"""A series' own variance scale counts at most this many times the median of all series':
one odd series moves the scale of S series by at most a factor 1 + 3/S."""

CHI2_1_MEDIAN = 0.4549364231195724
"""The median of a χ² variable of one degree of freedom: of z² for z standard normal."""


@dataclass(frozen=True)
class VarianceScale:
    """The forecast variance's scale c chosen on validation, how (`rule`: "per-series mean,
    bounded",
    "fallback: ..." or "none"), and the pooled mean of z² beside it (what one odd series moves)."""

    scale: float
    rule: str
    pooled: float


def variance_scale(predict: PredictMoments, series: SeriesData) -> float:
    """The scale c of the forecast's variance chosen on the validation part (see
    `choose_variance_scale`)."""
    return choose_variance_scale(predict, series).scale


def choose_variance_scale(predict: PredictMoments, series: SeriesData) -> VarianceScale:
    """The scale c of the forecast's variance chosen on the validation part, its values
    forecast as the test part is (`validation_leads`), z = (y − m)/√v. Each series with at
    least `MIN_SCALE_VALUES` observed values there proposes its own c_s = mean z² (the c that
    maximises its log-likelihood under N(m, c·v)), and c is their mean, each c_s bounded by
    `ODD_SERIES_BOUND` times their median: scale-free and balanced over the series, so one
    odd series (a level shift, a meter that wakes up) cannot set every series' interval (one series: its own c_s, from however many values). When no
    series of several has that many (a validation part of 24 steps),
    c = median of all z² / median of χ²₁, the robust pooled rule, said in one warning line.
    1 when the validation part has no observed value. The test part never enters it."""
    if series.val_end <= series.train_end:
        return VarianceScale(1.0, "none", 1.0)
    y, m, v = validation_leads(predict, series)
    seen = torch.isfinite(y) & torch.isfinite(m) & torch.isfinite(v)
    if not seen.any():
        return VarianceScale(1.0, "none", 1.0)
    z2 = torch.where(seen, (y - m) ** 2 / v, 0.0).double()
    pooled = z2[seen].mean().item()
    count = seen.sum(1)
    voters = count >= MIN_SCALE_VALUES
    if len(count) == 1:  # one series: its own mean z², however few its values
        voters = count > 0
    if voters.any():
        per_series = z2[voters].sum(1) / count[voters]
        bounded = per_series.clamp_max(ODD_SERIES_BOUND * per_series.median())
        return VarianceScale(bounded.mean().item(), "per-series mean, bounded", pooled)
    scale = z2[seen].median().item() / CHI2_1_MEDIAN
    rule = (f"fallback: {int(count.max())} validation value(s) per series < "
            f"{MIN_SCALE_VALUES}, median z² / median χ²₁")
    if get_rank() == 0:
        log.warning("forecast variance scale: the validation part is too short to choose it "
                    "series by series (%s); %.3g by the robust pooled rule (mean z² %.3g)",
                    rule.removeprefix("fallback: "), scale, pooled)
    return VarianceScale(scale, rule, pooled)


def validation_leads(predict: PredictMoments, series: SeriesData
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(observed, mean, variance) of validation values, standardised, forecast at the lead
    times the test part's protocol forecasts at. A recursive forecast errs more the further
    it runs from its origin; a one-step model fed its own predictions, over a test part
    longer than the validation part, would otherwise be scaled by its shorter leads only
    (its coverage fell from 95 % over the first quarter of the test part to 75 % over the
    last). So when the test protocol's longest forecast n is no longer than the validation
    part, the validation part is forecast under the same protocol from the training part's
    end; otherwise from origins one validation length apart back from there (as far as the
    lookback allows), each scoring only the validation values it reaches at leads up to n,
    so that every lead of the test forecast is scored about once. Values before an origin
    are observed ones: the training part's, never the test part's."""
    train_end, val_end = series.train_end, series.val_end
    longest = max(s for _, s in protocol(val_end, series.values.shape[1],
                                         series.forecast_every))
    length = val_end - train_end
    if longest <= length:
        val = forecast_part(predict, series, train_end, val_end)
        norm = series.norm
        return ((val.observed - norm.mean) / norm.std, (val.mean - norm.mean) / norm.std,
                val.var / norm.std ** 2)
    starts = [o for o in range(train_end, train_end - longest, -length)
              if o >= series.lookback] or [train_end]
    mean, var = _recursive(predict, series, starts, val_end - starts[-1])  # (R, S, n)
    observed = series.normalised[:, train_end:val_end].float()
    picked = []
    for r, origin in enumerate(starts):
        lead = torch.arange(train_end, val_end) - origin + 1
        keep = lead <= longest
        cols = (lead - 1)[keep]
        picked.append((observed[:, keep], mean[r][:, cols], var[r][:, cols]))
    return tuple(torch.cat(parts, 1) for parts in zip(*picked))


def calibrated_test(predict: PredictMoments, series: SeriesData) -> tuple[Forecast, float]:
    """The test part's forecast with its variance scaled by `variance_scale`, and the scale:
    what summary.json, forecast.png and `dptrain predict` report."""
    forecast, chosen = calibrated_test_chosen(predict, series)
    return forecast, chosen.scale


def calibrated_test_chosen(predict: PredictMoments, series: SeriesData
                           ) -> tuple[Forecast, VarianceScale]:
    """`calibrated_test` with how its scale was chosen."""
    chosen = choose_variance_scale(predict, series)
    forecast = forecast_test(predict, series)
    return dataclasses.replace(forecast, var=forecast.var * chosen.scale), chosen


# ------------------------------------------------------------------ the seasonal naive baseline
def seasonal_naive(series: SeriesData, start: int, end: int, season: int) -> Forecast:
    """The seasonal naive forecast of [start, end) under the series' protocol: from origin o,
    step j repeats the value one season before its own season's first step, y[o − m + j mod m]
    (the last observed value at or before it where that one is missing), with variance
    σ_s²·(⌊j/m⌋ + 1), σ_s² the mean squared seasonal difference of series s's training part."""
    plan = protocol(start, end, series.forecast_every)
    filled = forward_fill(series.normalised) * series.norm.std + series.norm.mean  # (S, T)
    sigma2 = _seasonal_difference_variance(series, season)  # (S, 1)
    longest = max(s for _, s in plan)
    j = torch.arange(longest)
    means = torch.stack([filled[:, o - season + j % season] for o, _ in plan])  # (R, S, n)
    var = (sigma2 * (j // season + 1)).expand_as(means[0])
    return _assemble(series, plan, means.float(), var.expand_as(means).float(),
                     standardised=False)


def _seasonal_difference_variance(series: SeriesData, season: int) -> torch.Tensor:
    """(S, 1) mean of (y_t − y_{t−m})² over the training part's observed pairs; the series'
    variance where there is no pair; never 0 (a constant series would get a zero variance and
    an infinite log-likelihood)."""
    train = series.values[:, :series.train_end].double()
    diff = train[:, season:] - train[:, :-season]
    seen = torch.isfinite(diff)
    count = seen.sum(1, keepdim=True)
    mean_sq = torch.where(seen, diff, 0.0).pow(2).sum(1, keepdim=True) / count.clamp_min(1)
    fallback = series.norm.std.double() ** 2
    sigma2 = torch.where(count > 0, mean_sq, fallback)
    return sigma2.clamp_min(1e-6 * fallback.clamp_min(1e-12))


def naive_test(series: SeriesData) -> tuple[Forecast, int]:
    """The seasonal naive forecast of the test part and its season m: of the candidate
    seasons (`SeriesData.seasons`), the one whose naive forecast of the validation part (same
    protocol) has the lowest ND; the first when there is no validation part. Test data never
    chooses (docs/tutorials/forecasting.md)."""
    seasons = [m for m in series.seasons if m <= series.train_end] or [1]
    season = seasons[0]
    if len(seasons) > 1 and series.val_end > series.train_end:
        scores = {m: forecast_metrics(seasonal_naive(series, series.train_end, series.val_end,
                                                     m), series)["nd"] for m in seasons}
        season = min(seasons, key=lambda m: (scores[m] if scores[m] == scores[m] else math.inf))
    return seasonal_naive(series, series.val_end, series.values.shape[1], season), season


# ------------------------------------------------------------------------------ the metrics
def forecast_metrics(forecast: Forecast, series: SeriesData) -> dict[str, float]:
    """rmse, log_likelihood, coverage_1sigma / 2sigma / 3sigma, nd, p90_loss, mase and
    mase_seasonal over the observed values of the forecast (docs/tutorials/forecasting.md)."""
    y, m, v = forecast.observed.double(), forecast.mean.double(), forecast.var.double()
    seen = torch.isfinite(y)
    y0 = torch.where(seen, y, 0.0)
    abs_err = torch.where(seen, (y0 - m).abs(), 0.0)
    count = seen.sum().item()
    log_lik = -0.5 * (math.log(2 * math.pi) + v.log() + (y0 - m) ** 2 / v)
    q90 = m + Z_90 * v.sqrt()
    pinball = torch.where(y0 >= q90, 0.9 * (y0 - q90), 0.1 * (q90 - y0))
    scale = y0.abs().sum().item()
    coverage = {f"coverage_{k}sigma": (seen & (abs_err <= k * v.sqrt())).sum().item() / count
                for k in (1, 2, 3)}
    return {
        "rmse": math.sqrt((abs_err ** 2).sum().item() / count),
        "log_likelihood": torch.where(seen, log_lik, 0.0).sum().item() / count,
        **coverage,
        "nd": abs_err.sum().item() / scale if scale > 0 else math.nan,
        "p90_loss": 2 * torch.where(seen, pinball, 0.0).sum().item() / scale
        if scale > 0 else math.nan,
        "mase": _mase(abs_err, seen, series, 1),
        "mase_seasonal": _mase(abs_err, seen, series, series.seasons[0]),
    }


def _mase(abs_err: torch.Tensor, seen: torch.Tensor, series: SeriesData, lag: int) -> float:
    """Mean over the series of the forecast's mean absolute error divided by the mean absolute
    difference between observed training values `lag` steps apart (lag 1: the one-step naive
    forecast's error in sample; lag m: the seasonal naive's)."""
    train = series.values[:, :series.train_end].double()
    change = (train[:, lag:] - train[:, :-lag]).abs()
    ratios = []
    for s in range(train.shape[0]):
        naive = change[s][torch.isfinite(change[s])]
        observed = seen[s].sum()
        if len(naive) and naive.mean() > 0 and observed:
            ratios.append((abs_err[s].sum() / observed / naive.mean()).item())
    return sum(ratios) / len(ratios) if ratios else math.nan


def forecast_report(predict: PredictMoments, series: SeriesData, out_dir: Path | None
                    ) -> dict[str, float]:
    """The forecast's metrics as `forecast_*` entries of summary.json, the seasonal naive
    forecast's beside them as `forecast_*_naive`, with the protocol (`forecast_every`: steps
    per origin), the seasons (`forecast_season`: m of mase_seasonal; `forecast_naive_season`:
    the naive forecast's) and the variance scale chosen on validation
    (`forecast_variance_scale`); with `out_dir` (rank 0) also forecast.png."""
    forecast, chosen = calibrated_test_chosen(predict, series)
    naive, season = naive_test(series)
    forecast, failed = _without_broken(forecast, series)
    if failed:  # the others' metrics stand; the naive is scored on the same series
        naive = dataclasses.replace(naive, observed=forecast.observed)
    if out_dir is not None:
        plot_forecast(out_dir / "forecast.png", series, forecast, naive)
    report: dict[str, Any] = {f"forecast_{k}": v
                              for k, v in forecast_metrics(forecast, series).items()}
    report.update({f"forecast_{k}_naive": v
                   for k, v in forecast_metrics(naive, series).items()})
    if failed:
        report["forecast_failed_series"] = failed
    report.update(forecast_every=series.forecast_every or forecast.mean.shape[1],
                  forecast_season=series.seasons[0], forecast_naive_season=season,
                  forecast_variance_scale=chosen.scale,
                  forecast_variance_scale_rule=chosen.rule,
                  forecast_variance_scale_pooled=chosen.pooled)
    return report


def _without_broken(forecast: Forecast, series: SeriesData) -> tuple[Forecast, list[str]]:
    """The forecast with the series whose forecast could not be computed (a non-finite mean
    or variance) left out of its metrics (their observed values NaN, their moments 0 and 1),
    and their names, said in one warning line."""
    broken = ~(torch.isfinite(forecast.mean) & torch.isfinite(forecast.var)).all(1)
    if not broken.any():
        return forecast, []
    names = [series.names[s] for s in broken.nonzero()[:, 0].tolist()]
    if get_rank() == 0:
        log.warning("the forecast of %d series could not be computed (non-finite moments) and "
                    "is left out of the forecast metrics: %s", len(names), ", ".join(names))
    keep = ~broken[:, None]
    return dataclasses.replace(
        forecast, mean=torch.where(keep, forecast.mean, 0.0),
        var=torch.where(keep, forecast.var, 1.0),
        observed=torch.where(keep, forecast.observed, math.nan)), names


MAX_PANELS = 4


def plot_forecast(path: Path, series: SeriesData, forecast: Forecast,
                  naive: Forecast | None = None) -> bool:
    """The observed series (up to `MAX_PANELS` of them), the forecast mean and its ±2σ band
    over the test part, the seasonal naive forecast dotted, the split points and (rolling
    origins) the origins as dashed lines."""
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
        if naive is not None:
            ax.plot(ahead, naive.mean[s], color="C2", lw=0.8, ls=":", label="seasonal naive")
        for split_at in (series.train_end, series.val_end):
            ax.axvline(split_at, color="grey", ls="--", lw=0.8)
        for origin in forecast.origins.unique()[1:].tolist():
            ax.axvline(origin, color="0.7", ls=":", lw=0.6)
        ax.set_title(series.names[s], fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel(f"time step (train | validation | test; {series.times[0]} to "
                           f"{series.times[-1]})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
