"""The learning rate is a function of the global optimizer step (docs/reference/gradient_learner.md,
Optimizers and schedules): each schedule's trace equals its closed form at chosen steps, and a
run's schedule is laid over its own length in optimizer steps."""

from __future__ import annotations

import math

import pytest

from dptrain.errors import ConfigError
from dptrain.learners.build import RunLength, lr_schedule
from dptrain.learners.config import LearnerConfig
from dptrain.learners.schedule import LrSchedule, scaled_lr

PEAK, TOTAL, WARM = 0.8, 100, 10


def test_warmup_ramps_linearly_from_its_start_factor_to_the_peak():
    s = LrSchedule(peak=PEAK, total_steps=TOTAL, warmup_steps=WARM, warmup_start=0.1)
    assert s.lr(0) == pytest.approx(0.08)
    assert s.lr(5) == pytest.approx(0.8 * (0.1 + 0.9 * 5 / 10))  # 0.44
    assert s.lr(9) == pytest.approx(0.8 * (0.1 + 0.9 * 0.9))
    assert s.lr(10) == PEAK and s.lr(99) == PEAK


@pytest.mark.parametrize("kind, step, expected", [
    ("constant", 50, 0.8),
    ("step", 10, 0.8), ("step", 29, 0.8), ("step", 30, 0.08), ("step", 70, 0.8 * 0.1 ** 3),
    ("multistep", 39, 0.8), ("multistep", 40, 0.08), ("multistep", 80, 0.8 * 0.01),
    ("cosine", 10, 0.8), ("cosine", 55, 0.05 + 0.75 * 0.5),
    ("cosine", 99, 0.05 + 0.75 * (1 + math.cos(math.pi * 89 / 90)) / 2),
    ("linear", 10, 0.8), ("linear", 55, 0.8 - 0.75 * 45 / 90), ("linear", 99, 0.8 - 0.75 * 89 / 90),
    # wsd: 90 steps after warmup, the last 20 % (18) decaying: stable through step 81
    ("wsd", 81, 0.8), ("wsd", 82, 0.8 - 0.75 * 1 / 18), ("wsd", 99, 0.05),
])
def test_each_schedule_follows_its_closed_form(kind, step, expected):
    s = LrSchedule(peak=PEAK, total_steps=TOTAL, warmup_steps=WARM, kind=kind, min_lr=0.05,
                   step_size=20, milestones=(40, 80), decay=0.1, wsd_decay=0.2)
    assert s.lr(step) == pytest.approx(expected, rel=1e-12)


def test_scaling_rules():
    assert scaled_lr(0.1, 8192, 256, "linear") == pytest.approx(3.2)  # Goyal et al.'s 0.1 x k
    assert scaled_lr(1e-3, 1024, 256, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(0.1, 8192, 256, "none") == 0.1


def test_a_run_lays_the_schedule_over_its_optimizer_steps():
    """1000 samples at global batch 64: 16 steps per epoch (the last one padded), 3 epochs;
    warmup and milestones in epochs become steps; linear scaling from batch 256."""
    config = LearnerConfig(lr=0.4, lr_scaling="linear", warmup=1, schedule="multistep",
                           milestones="1.5,2")
    s = lr_schedule(config, 1000, RunLength(batch_size=64, epochs=3))
    assert (s.peak, s.total_steps, s.warmup_steps, s.milestones) == (0.1, 48, 16, (24, 32))
    steps = lr_schedule(LearnerConfig(warmup=5, schedule_unit="steps", schedule="cosine"),
                        1000, RunLength(batch_size=64, epochs=3))
    assert (steps.warmup_steps, steps.total_steps) == (5, 48)
    assert lr_schedule(LearnerConfig(), 1000, RunLength(64, 3)) is None  # a fixed Adam rate


@pytest.mark.parametrize("options, message", [
    ({"warmup": 3}, "warmup 3 epochs is as long as the run or longer"),
    ({"warmup": 48, "schedule_unit": "steps"}, "warmup 48 steps is as long as the run"),
    ({"schedule": "multistep", "milestones": "1,3"}, "milestones: 3 epochs is at or past the end"),
    ({"schedule": "multistep", "milestones": "2,1"}, "milestones: expected increasing"),
    ({"schedule": "multistep"}, "multistep needs them"),
    ({"schedule": "cosine", "min_lr": 0.1}, "min-lr 0.1 must lie in [0, the peak learning rate"),
])
def test_a_schedule_that_does_not_fit_the_run_is_one_line(options, message):
    with pytest.raises(ConfigError, match=None) as caught:
        lr_schedule(LearnerConfig(**options), 1000, RunLength(batch_size=64, epochs=3))
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
