"""The learning rate as a pure function of the global optimizer step.

    from dptrain.learners.schedule import LrSchedule

    schedule = LrSchedule(peak=0.4, total_steps=9000, warmup_steps=500, kind="cosine")
    schedule.lr(0), schedule.lr(500), schedule.lr(8999)   # warmup start, peak, near min_lr

A schedule holds no state: the rate of step k (counted from 0, one per optimizer step, so
gradient accumulation's micro-batches do not count) is computed from k alone, every step. The
learner stores k in its checkpoints, so a resumed run, a run on another number of processes
and an elastic resize all apply the same rate at the same step; a chain of stateful torch
schedulers (`SequentialLR`) has to get its own state right after every resume instead.

Warmup, when any, ramps linearly from `warmup_start` x peak at step 0 towards the peak, which
step `warmup_steps` reaches (torchvision's `LinearLR(start_factor, total_iters)`). After it, at
t = k - warmup_steps of T = total_steps - warmup_steps:

    constant   peak
    step       peak x decay^floor(t / step_size)
    multistep  peak x decay^(milestones at or below k)     (milestones count from step 0)
    cosine     min_lr + (peak - min_lr) x (1 + cos(pi t / T)) / 2
    linear     peak + (min_lr - peak) x t / T
    wsd        peak until the last `wsd_decay` share of T, then linear to min_lr

With `decay_steps` (a run counted in steps: `--lr-decay-steps`, nanoGPT's `lr_decay_iters`), T is
decay_steps - warmup_steps instead, and from step decay_steps on the rate is min_lr exactly
(cosine, linear and wsd); the run may end before or after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dptrain.errors import ConfigError

ScheduleKind = Literal["constant", "step", "multistep", "cosine", "linear", "wsd"]
SCHEDULES: tuple[str, ...] = ("constant", "step", "multistep", "cosine", "linear", "wsd")
LrScaling = Literal["none", "linear", "sqrt"]
LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """The learning rate of each optimizer step of a run of `total_steps` steps."""

    peak: float
    """The rate warmup reaches and decay starts from (already scaled for the global batch)."""
    total_steps: int
    """Optimizer steps of the whole run (epochs x steps per epoch)."""
    kind: ScheduleKind = "constant"
    warmup_steps: int = 0
    warmup_start: float = 0.01
    """Warmup's first rate as a fraction of the peak."""
    min_lr: float = 0.0
    """Where cosine, linear and wsd end."""
    step_size: int = 0
    """step: steps between two decays."""
    milestones: tuple[int, ...] = ()
    """multistep: the steps at which the rate is multiplied by `decay`."""
    decay: float = 0.1
    """step and multistep: the factor of each decay."""
    wsd_decay: float = 0.2
    """wsd: the share of the steps after warmup spent decaying."""
    decay_steps: int | None = None
    """The step at which cosine, linear and wsd reach min_lr, and stay after it; None: the rate
    of the last step (total_steps - 1) holds past the end."""

    def __post_init__(self) -> None:
        check_schedule(self)

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (from 0); past the end, the last one's."""
        k = min(max(step, 0), self.total_steps - 1)
        if k < self.warmup_steps:
            return self.peak * (self.warmup_start
                                + (1.0 - self.warmup_start) * k / self.warmup_steps)
        decays_to_min = self.kind in ("cosine", "linear", "wsd")
        end = self.decay_steps if self.decay_steps is not None and decays_to_min \
            else self.total_steps
        if k >= end:  # past --lr-decay-steps
            return self.min_lr
        t, span = k - self.warmup_steps, max(end - self.warmup_steps, 1)
        if self.kind == "constant":
            return self.peak
        if self.kind == "step":
            return self.peak * self.decay ** (t // self.step_size)
        if self.kind == "multistep":
            return self.peak * self.decay ** sum(1 for m in self.milestones if m <= k)
        if self.kind == "cosine":
            return self.min_lr + (self.peak - self.min_lr) * (1 + math.cos(math.pi * t / span)) / 2
        if self.kind == "linear":
            return self.peak + (self.min_lr - self.peak) * t / span
        decay_steps = max(round(self.wsd_decay * span), 1)
        stable = span - decay_steps
        if t < stable:
            return self.peak
        return self.peak + (self.min_lr - self.peak) * (t - stable + 1) / decay_steps


def check_schedule(s: LrSchedule) -> None:
    """One line per inconsistency, named with the command line's spelling."""
    if s.kind not in SCHEDULES:
        raise ConfigError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {s.kind!r}")
    if not (math.isfinite(s.peak) and s.peak > 0):
        raise ConfigError(f"lr: expected a learning rate > 0, got {s.peak!r}")
    if s.total_steps < 1:
        raise ConfigError(f"the run has {s.total_steps} optimizer steps; it needs one at least")
    if s.warmup_steps < 0:
        raise ConfigError(f"warmup: expected >= 0, got {s.warmup_steps} steps")
    if s.warmup_steps >= s.total_steps and s.warmup_steps:
        raise ConfigError(f"warmup: {s.warmup_steps} steps is as long as the run or longer "
                          f"({s.total_steps} optimizer steps); shorten it or train longer")
    if not 0.0 <= s.warmup_start <= 1.0:
        raise ConfigError(f"warmup-start: expected a fraction of the peak in [0, 1], got "
                          f"{s.warmup_start!r}")
    if s.min_lr < 0 or s.min_lr > s.peak:
        raise ConfigError(f"min-lr {s.min_lr:g} must lie in [0, the peak learning rate "
                          f"{s.peak:g}]")
    if s.kind in ("step", "multistep") and not 0.0 < s.decay <= 1.0:
        raise ConfigError(f"lr-decay: expected a factor in (0, 1], got {s.decay!r}")
    if s.kind == "step" and s.step_size < 1:
        raise ConfigError(f"lr-step-size: schedule step needs a step size of at least one "
                          f"optimizer step, got {s.step_size}")
    if s.kind == "multistep":
        if not s.milestones:
            raise ConfigError("milestones: schedule multistep needs them (e.g. --milestones "
                              "30,60,80)")
        if list(s.milestones) != sorted(set(s.milestones)) or s.milestones[0] < 1:
            raise ConfigError(f"milestones: expected increasing positive values, got "
                              f"{list(s.milestones)} (in optimizer steps)")
        if s.milestones[-1] >= s.total_steps:
            raise ConfigError(f"milestones: {s.milestones[-1]} is at or past the end of the "
                              f"run ({s.total_steps} optimizer steps)")
    if s.decay_steps is not None and s.decay_steps <= s.warmup_steps:
        raise ConfigError(f"lr-decay-steps {s.decay_steps} is not longer than the warmup "
                          f"({s.warmup_steps} steps): the decay would end before it starts")
    if s.kind == "wsd" and not 0.0 < s.wsd_decay <= 1.0:
        raise ConfigError(f"wsd-decay: expected a share in (0, 1], got {s.wsd_decay!r}")


def scaled_lr(lr: float, batch_size: int, lr_batch: int, scaling: LrScaling) -> float:
    """`lr` given for global batch `lr_batch`, at global batch `batch_size`: linear (Goyal et
    al. 2017), square root, or as given."""
    if scaling == "linear":
        return lr * batch_size / lr_batch
    if scaling == "sqrt":
        return lr * math.sqrt(batch_size / lr_batch)
    return lr
