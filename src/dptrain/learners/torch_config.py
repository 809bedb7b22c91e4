"""`TorchLearnerConfig`: how a `TorchLearner` trains, validated; and which metric a loss implies."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.errors import ConfigError
from dptrain.learners.schedule import LrSchedule

Strategy = Literal["ddp", "fsdp"]
Precision = Literal["32", "bf16", "fp16"]
Task = Literal["auto", "classification", "regression"]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")
PRECISIONS: tuple[str, ...] = ("32", "bf16", "fp16")
TASKS: tuple[str, ...] = ("auto", "classification", "regression")
# fp16 needs a GradScaler and is only worth it where float16 kernels are fast; on CPU use bf16.
FP16_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
STATE_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class TorchLearnerConfig:
    """How a `TorchLearner` trains; every field has the same name as its keyword argument."""

    strategy: Strategy = "ddp"
    """"ddp": full replica per rank, gradients all-reduced. "fsdp": FSDP2 `fully_shard` on each
    child module that has parameters, then on the root; sharded checkpoints via DCP."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step (k). Gradients are synchronised once, on the last."""
    precision: Precision = "32"
    """"32", "bf16" (autocast on CPU and CUDA) or "fp16" (autocast + GradScaler, CUDA only)."""
    sync_batchnorm: bool = False
    """BatchNorm statistics over the global batch (all ranks) instead of each rank's share."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this value before each optimizer step."""
    task: Task = "auto"
    """Which metric train/eval steps report: "classification" -> argmax error, "regression" ->
    squared error; "auto" decides from the loss (CrossEntropy/NLL vs MSE/L1/Huber)."""
    lr_schedule: LrSchedule | None = None
    """The learning rate of every optimizer step, a function of the step alone: before each
    step each parameter group's rate is set to `lr_schedule.lr(step)` times the group's share
    of the optimizer's first group's initial rate. None: the optimizer's rates are left alone
    (a `scheduler_factory` may change them)."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay per update (0: none);
    it is evaluated beside the live model (metrics `ema_*`) and checkpointed with it."""
    ema_every: int = 1
    """Update the average after every this many optimizer steps."""
    compile: bool = False
    """Run the training forward through `torch.compile` of the wrapped module (DDP's or
    FSDP's; backward through its compiled graph too). The same math, up to the order of float
    sums; evaluation stays eager. A model it cannot compile trains eagerly after one log line."""

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("task", self.task, TASKS)
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"TorchLearnerConfig.accumulation_steps must be an integer >= 1, "
                              f"got {steps!r}")
        if not isinstance(self.sync_batchnorm, bool):
            raise ConfigError(f"TorchLearnerConfig.sync_batchnorm must be True or False, "
                              f"got {self.sync_batchnorm!r}")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm <= 0):
            raise ConfigError(f"TorchLearnerConfig.max_grad_norm must be a finite number > 0 or "
                              f"None, got {norm!r}")
        if self.lr_schedule is not None and not isinstance(self.lr_schedule, LrSchedule):
            raise ConfigError(f"TorchLearnerConfig.lr_schedule must be an LrSchedule or None, "
                              f"got {type(self.lr_schedule).__name__}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"TorchLearnerConfig.ema_decay must be in [0, 1) (0: no EMA), "
                              f"got {self.ema_decay!r}")
        every = self.ema_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"TorchLearnerConfig.ema_every must be an integer >= 1, "
                              f"got {every!r}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"TorchLearnerConfig.{name} must be one of "
                          f"{', '.join(repr(a) for a in allowed)}, got {value!r}")


_CLASSIFICATION_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)
_REGRESSION_LOSSES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)
_CLASSIFICATION_FNS = (F.cross_entropy, F.nll_loss)
_REGRESSION_FNS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)


def resolve_task(loss_fn: Callable[..., torch.Tensor],
                 task: Task = "auto") -> Literal["classification", "regression"]:
    """The metric family for `loss_fn`: given explicitly, or recognised from torch's losses."""
    if task != "auto":
        return task
    if isinstance(loss_fn, _CLASSIFICATION_LOSSES) or loss_fn in _CLASSIFICATION_FNS:
        return "classification"
    if isinstance(loss_fn, _REGRESSION_LOSSES) or loss_fn in _REGRESSION_FNS:
        return "regression"
    raise ConfigError(f"cannot tell whether the loss {loss_fn!r} is for classification or "
                      f"regression; pass task='classification' (metric: argmax error) or "
                      f"task='regression' (metric: squared error)")
