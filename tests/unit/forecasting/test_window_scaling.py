"""Window scaling (`dptrain.learners.window_scaling`, --window-scaling): what a window-scaled
TAGI model sees and gives back, when auto turns it on, and what it refuses (issue 39)."""

from __future__ import annotations

import logging
from datetime import timedelta

import numpy as np
import pytest
import torch

from dptrain.data import load_dataset
from dptrain.data.datasets.series import series_split
from dptrain.errors import ConfigError
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.learners.window_scaling import FLOOR, WindowScaling, choose, shifted_series
from dptrain.runtime import Runtime
from dptrain.runtime.env import SINGLE


def _values(shift: float = 0.0, dead: bool = False) -> np.ndarray:
    """Four hourly series of 240 steps (168 training, 24 validation); series 0 shifted by
    `shift` of its training std from the validation part on, or dead (zeros) in training."""
    rng = np.random.default_rng(0)
    t = np.arange(240)
    values = np.array([10 * (s + 1) * (1 + 0.3 * np.sin(2 * np.pi * t / 24 + s))
                       + rng.normal(0, 1, len(t)) for s in range(4)])
    values[0, 168:] += shift * values[0, :168].std()
    if dead:
        values[1, :168] = 0.0
    return values


def _series(values: np.ndarray, lookback: int = 12):
    return series_split("load", [f"m{s}" for s in range(len(values))],
                        [str(x) for x in range(values.shape[1])], values, lookback=lookback,
                        horizon=2, val_size=24, test_size=48)


def test_a_window_is_scaled_by_its_own_mean_and_spread_and_the_moments_come_back_exactly():
    scaling = WindowScaling(lookback=3, features=2)  # value, covariate per step; then an id
    x = torch.tensor([[1.0, 9.0, 2.0, 9.0, 3.0, 9.0, 5.0],
                      [4.0, 7.0, 4.0, 7.0, 4.0, 7.0, 6.0]])  # the second window flat
    var_x = torch.full_like(x, 0.5)
    stats = scaling.stats(x)
    spread = np.std([1.0, 2.0, 3.0])
    assert stats.mean.flatten().tolist() == pytest.approx([2.0, 4.0])
    assert stats.spread.flatten().tolist() == pytest.approx([spread, FLOOR])  # flat: the floor
    scaled, scaled_var = scaling.inputs(x, var_x, stats)
    assert scaled[0, [0, 2, 4]].tolist() == pytest.approx([-1 / spread, 0.0, 1 / spread])
    assert scaled[1, [0, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    assert scaled_var[0, [0, 2, 4]].tolist() == pytest.approx([0.5 / spread ** 2] * 3)
    # the covariates and the series id are left as they are, means and variances
    kept = [1, 3, 5, 6]
    assert torch.equal(scaled[:, kept], x[:, kept]) and torch.equal(scaled_var[:, kept],
                                                                      var_x[:, kept])
    y = torch.tensor([[4.0, 5.0], [4.5, float("nan")]])
    target = scaling.targets(y, stats)
    assert torch.isnan(target[1, 1])  # a missing target stays missing
    mean, var = scaling.outputs(target, torch.ones_like(target), stats)
    assert torch.allclose(mean[:, 0], y[:, 0]) and torch.isnan(mean[1, 1])
    assert var[:, 0].tolist() == pytest.approx([spread ** 2, FLOOR ** 2])


def test_auto_turns_it_on_where_a_series_leaves_its_training_range_and_says_so_once(caplog):
    assert shifted_series(_series(_values()).series) == []
    assert choose(_series(_values()).series, "auto", "load.csv") is None
    assert choose(_series(_values()).series, "on", "load.csv") is not None
    shifted = _series(_values(shift=6.0)).series
    with caplog.at_level(logging.WARNING, logger="dptrain.learners.window_scaling"):
        scaling = choose(shifted, "auto", "load.csv")
    assert scaling == WindowScaling(lookback=12, features=1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "load.csv: 1 series leave their training range" in lines[0]
    assert "m0 (mean +6.0 σ" in lines[0] and "--window-scaling off" in lines[0], lines
    assert choose(shifted, "off", "load.csv") is None
    # a meter dead over its training part that is alive in validation is one too
    assert [name.split()[0] for name in shifted_series(_series(_values(dead=True)).series)] \
        == ["m1"]


def _learner(split, model: str = "tagi-lstm", scaling: str = "auto", **options):
    learner = create_learner(ModelConfig(model=model, hidden=8, window_scaling=scaling,
                                         **options), LearnerConfig(), split, seed=0)
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    return learner


@pytest.mark.parametrize("heteroscedastic", [False, True])
def test_a_window_scaled_learner_reports_and_predicts_in_the_series_units(heteroscedastic):
    """The learner's metrics and predictions of a window-scaled model are those of its
    network's outputs scaled back: a series ten times as large predicts ten times as large
    (the windows' units are the same), and its squared error is a hundred times as large."""
    values = _values()
    split = _series(values)
    learner = _learner(split, scaling="on", heteroscedastic=heteroscedastic)
    for idx in torch.arange(len(split.train)).split(32):
        learner.train_step(split.train[idx])
    x, y = split.validation[torch.arange(len(split.validation))]
    mean, std = learner.predict(x)
    big_x = x.clone()
    big_x[:, :12] = 10 * big_x[:, :12]
    big_mean, big_std = learner.predict(big_x)
    assert torch.allclose(big_mean, 10 * mean, rtol=1e-4, atol=1e-4)
    assert torch.allclose(big_std, 10 * std, rtol=1e-4)
    moments = learner.predict_moments(big_x, torch.zeros_like(big_x))
    assert torch.allclose(moments[0], big_mean, atol=1e-5)
    assert torch.allclose(moments[1].sqrt(), big_std, rtol=1e-5)
    sums = learner.eval_step((x, y))
    big_sums = learner.eval_step((big_x, 10 * y))
    assert big_sums["mse"][0] == pytest.approx(100 * sums["mse"][0], rel=1e-3)
    assert big_sums["coverage_2sigma"] == sums["coverage_2sigma"]


def test_it_is_refused_where_there_is_no_window_to_scale():
    with pytest.raises(ConfigError, match="torch model"):
        _learner(_series(_values()), model="torch-mlp", scaling="on")
    with pytest.raises(ConfigError, match="not one"):
        _learner(load_dataset("toy1d"), model="tagi-mlp", scaling="on")
    # auto leaves a torch model's windows as they are, shifted series or not: no refusal
    assert _learner(_series(_values(shift=6.0)), model="torch-mlp").task == "regression"
