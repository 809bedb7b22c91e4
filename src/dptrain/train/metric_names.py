"""Metric naming: the columns a learner's metrics become, and the metric that chooses when
none is named.

    derived({"loss": 1.2, "mse": 4.0}, "val")   # {"val_loss": 1.2, "val_mse": 4.0, "val_rmse": 2.0}
    metric_names(["loss", "error"], "test")     # ["test_loss", "test_error"]
    split_monitor(split)                        # "val_error", "val_rmse", ... or "" (no validation)

A learner reports its metrics by bare name (`loss`, `error`, `mse`); the Trainer reports them
prefixed by their part (`train`, `val`, `test`), with the figures derived from them: rmse from
mse, and those the model's family derives (`MetricExtras.derive`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from dptrain.data import Split
from dptrain.train.extras import NONE, MetricExtras


def derived(means: dict[str, float], prefix: str, extras: MetricExtras = NONE
            ) -> dict[str, float]:
    """`{prefix}_{name}` per metric, plus rmse from mse (and ema_rmse from ema_mse), and the
    figures the model's family derives (`extras.derive`)."""
    out = {f"{prefix}_{k}": v for k, v in means.items()}
    for name in ("mse", "ema_mse"):
        if name in means:
            out[f"{prefix}_{name[:-3]}rmse"] = math.sqrt(means[name])
    if extras.derive is not None:
        out.update(extras.derive(means, prefix))
    return out


def metric_names(reported: Iterable[str], prefix: str, extras: MetricExtras = NONE
                 ) -> list[str]:
    """The columns of epochs.csv that metrics reported as `reported` become (`train`, `val`
    or `test` prefix, rmse from mse, the family's derived figures)."""
    return list(derived(dict.fromkeys(reported, 1.0), prefix, extras))


def default_monitor(task: str, has_validation: bool, family: str | None = None,
                    multi_series: bool = False) -> str:
    """The metric that chooses when none is named: the model family's (`family`, a bare
    metric name such as "loss": val_loss), else the validation error (classification) or
    RMSE (regression; windows of several time series: the per-series-balanced
    `val_series_nrmse`, which one odd series cannot capture,
    `dptrain.learners.series_metrics`); "" (nothing chosen) without a validation part."""
    if not has_validation:
        return ""
    if family:
        return f"val_{family}"
    if task == "classification":
        return "val_error"
    return "val_series_nrmse" if multi_series else "val_rmse"


def split_monitor(split: Split, extras: MetricExtras = NONE) -> str:
    """`default_monitor` of `split`, for a model family that adds `extras`."""
    return default_monitor(split.task, split.validation is not None, extras.monitor,
                           split.series is not None and len(split.series.names) > 1)
