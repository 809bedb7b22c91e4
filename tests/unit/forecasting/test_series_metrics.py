"""The per-series-balanced validation measure of multi-series windows (`series_nrmse`,
dptrain.learners.series_metrics) that chooses a multi-series forecasting run's best epoch:
its definition, its reduction as (sum, count) per series over shares of the windows
(contract 5), and that one odd series cannot capture it, as it captures the pooled RMSE
(issue 39)."""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
import torch

from dptrain.data.datasets.series import series_split
from dptrain.data.loader import fetch_batch
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.learners.series_metrics import pop_series_nrmse, series_sums
from dptrain.runtime import Runtime
from dptrain.runtime.collectives import means
from dptrain.runtime.env import SINGLE
from dptrain.train.trainer import split_monitor


def _split(shift: float):
    """Eight hourly series of 200 steps, 40 validated; series 0 shifted by `shift` of its
    training std in its validation part."""
    rng = np.random.default_rng(0)
    t = np.arange(200)
    values = np.array([10 * (s + 1) * (1 + 0.3 * np.sin(2 * np.pi * t / 24 + s))
                       + rng.normal(0, 1, len(t)) for s in range(8)])
    values[0, 140:160] += shift * values[0, :140].std()
    return series_split("t", [f"s{s}" for s in range(8)], [str(x) for x in t], values,
                        lookback=12, horizon=1, train_fraction=0.7, val_fraction=0.1)


def _learner(split, model: str = "tagi-mlp"):
    learner = create_learner(ModelConfig(model=model, hidden=16), LearnerConfig(), split,
                             seed=0)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    for idx in torch.randperm(len(split.train), generator=torch.Generator().manual_seed(0)
                              ).split(16):
        learner.train_step(split.train[idx])
    return learner


def _evaluate(learner, part, shares: int = 1) -> dict[str, float]:
    """The Trainer's evaluation of `part` with its windows split in `shares` (as ranks hold
    them), the shares' sums added as the reduction over ranks adds them."""
    sums: dict[str, tuple[float, float]] = {}
    for indices in torch.arange(len(part)).tensor_split(shares):
        for name, (s, c) in learner.eval_step(fetch_batch(part, 0, indices)).items():
            total = sums.get(name, (0.0, 0.0))
            sums[name] = (total[0] + s, total[1] + c)
    return learner.end_evaluation(means(sums), "val")


@pytest.mark.parametrize("model", ["tagi-mlp", "torch-mlp"])
def test_series_nrmse_is_the_bounded_mean_of_each_series_rmse_however_the_windows_are_shared(
        model):
    """Definition and contract 5: from the model's own predictions, each series' RMSE in its
    standard units, each at most 4x their median, averaged; the same from one share of the
    windows or from three (three ranks' sums)."""
    split = _split(shift=0.0)
    learner = _learner(split, model)
    part = split.validation
    x, y = part.x, part.y
    if model == "tagi-mlp":
        mean = learner.predict(x)[0]
    else:
        with torch.no_grad():
            mean = learner.module.eval()(x)
    err2 = ((mean.double() - y.double()) ** 2).squeeze(1)
    rmse = torch.stack([err2[part.series == s].mean().sqrt() for s in range(8)])
    expected = rmse.clamp_max(4 * rmse.median()).mean().item()
    whole, shared = _evaluate(learner, part), _evaluate(learner, part, shares=3)
    assert whole["series_nrmse"] == pytest.approx(expected, rel=1e-5)
    # float32 forwards of other batch shapes round differently: not bits, 1e-6
    assert shared["series_nrmse"] == pytest.approx(whole["series_nrmse"], rel=1e-6)
    assert not any(name.startswith("_series") for name in whole)  # sums are not columns
    assert "mse" in whole  # the pooled one is reported beside it
    if model == "tagi-mlp":  # with predictive variances: the per-series-balanced coverage
        mean, total_std = learner.predict(x)
        inside = ((mean - y).abs() <= 2 * total_std).squeeze(1).double()
        coverage = torch.stack([inside[part.series == s].mean() for s in range(8)]).mean()
        assert whole["series_coverage_2sigma"] == pytest.approx(coverage.item(), rel=1e-6)
        assert shared["series_coverage_2sigma"] == pytest.approx(coverage.item(), rel=1e-6)
        assert "coverage_2sigma" in whole
    else:  # a torch model has no interval
        assert "series_coverage_2sigma" not in whole


def test_one_odd_series_cannot_capture_it_as_it_captures_the_pooled_rmse():
    """Issue 39: a level shift of 30 training stds in one series' validation part sets the
    pooled validation RMSE; it moves the per-series measure of 8 series by at most 3/8 of the
    typical series' RMSE."""
    clean, shifted = _split(shift=0.0), _split(shift=30.0)
    learner = _learner(clean)  # the same model: only the validation values differ
    before, after = (_evaluate(learner, split.validation) for split in (clean, shifted))
    assert math.sqrt(after["mse"]) > 5 * math.sqrt(before["mse"])
    per_series = [
        math.sqrt(m) for m in means(series_sums(
            ((learner.predict(clean.validation.x)[0] - clean.validation.y) ** 2),
            torch.ones_like(clean.validation.y, dtype=torch.bool),
            clean.validation.series)).values()]
    typical = float(np.median(per_series))
    assert after["series_nrmse"] - before["series_nrmse"] <= 3 / 8 * typical + 1e-9


def test_pop_series_nrmse_bounds_each_series_at_four_medians():
    sums = {**{f"_series_mse:{s}": (4.0, 4.0) for s in range(9)},  # RMSE 1 each
            "_series_mse:9": (1e6, 1.0), "mse": (1.0, 1.0)}
    reduced = pop_series_nrmse(means(sums), "val")
    assert reduced == {"mse": 1.0, "series_nrmse": pytest.approx((9 + 4) / 10)}
    # it chooses: the test part reports the pooled metrics alone, as before it
    assert pop_series_nrmse(means(sums), "test") == {"mse": 1.0}


def test_series_coverage_counts_each_series_once_whatever_its_windows():
    """Nine series whose intervals hold every value and one that misses them all: 90 %, as
    the series are counted, where the pooled coverage of the windows (the odd series holding
    91 of 100) would be 9 %."""
    sums = {**{f"_series_cov2:{s}": (1.0, 1.0) for s in range(9)},
            "_series_cov2:9": (0.0, 91.0), "_series_mse:0": (1.0, 1.0)}
    reduced = pop_series_nrmse(means(sums), "val")
    assert reduced["series_coverage_2sigma"] == pytest.approx(0.9)
    assert not any(name.startswith("_series") for name in reduced)
    assert "series_coverage_2sigma" not in pop_series_nrmse(means(sums), "test")


def test_several_series_choose_by_it_one_series_by_the_rmse():
    assert split_monitor(_split(shift=0.0)) == "val_series_nrmse"
    one = series_split("t", ["a"], [str(x) for x in range(100)], np.sin(np.arange(100.0))[None],
                       lookback=5, horizon=1)
    assert split_monitor(one) == "val_rmse"


def test_a_run_resumed_goes_on_with_the_monitor_it_began_with(tmp_path):
    """A multi-series run written before `val_series_nrmse` (its early-stopping state names no
    monitor) resumes choosing by `val_rmse`, the default then: its best value is an RMSE. A
    saved monitor is kept, and a monitor the command names stays the command's."""
    from dptrain.runtime import init_distributed
    from dptrain.train.early_stopping import EarlyStopping
    from dptrain.train.trainer import Trainer, TrainConfig

    split = _split(shift=0.0)

    def trainer(**config) -> Trainer:
        return Trainer(_learner(split), split, TrainConfig(out_dir=tmp_path, **config),
                       init_distributed())

    old = {"best": 0.5, "best_epoch": 2, "bad_epochs": 0}
    resumed = trainer()
    assert resumed.monitor == "val_series_nrmse"
    resumed._monitor_as_saved(old)
    assert resumed.monitor == resumed.early.monitor == "val_rmse"
    kept = trainer()
    kept._monitor_as_saved(EarlyStopping("val_series_nrmse").state_dict())
    assert kept.monitor == "val_series_nrmse"
    named = trainer(monitor="val_mae")
    named._monitor_as_saved(old)
    assert named.monitor == "val_mae"
