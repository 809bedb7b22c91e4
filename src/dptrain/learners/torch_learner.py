"""`TorchLearner`: data-parallel training of any `torch.nn.Module` with a loss and an optimizer.

    import functools, torch
    from torch import nn
    from dptrain.runtime import distributed
    from dptrain.learners import TorchLearner

    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    learner = TorchLearner(model, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1))
    with distributed() as rt:
        learner.setup(rt)                                 # DDP-wrapped, identical replicas
        x, y = torch.randn(8, 10), torch.randn(8, 5)      # this rank's share of the batch
        metrics = learner.train_step((x, y))              # {"loss": (sum, count), ...}

`strategy="ddp"` keeps a full replica per rank and all-reduces gradients (torch's
DistributedDataParallel); `strategy="fsdp"` shards parameters, gradients and optimizer state with
FSDP2's `fully_shard`. Both average gradients over ranks, so N ranks with local batch B take the
same step as one process with batch N*B and a mean loss, provided every rank's batch has the same
size (the ShardedSampler's train mode guarantees it).

This module is the training step and the evaluation. The wrappers (BatchNorm over the global
batch, activation checkpointing, torch.compile, FSDP or DDP) are applied from outside the model
by `dptrain.learners.parallelize`; what checkpoints hold, in each strategy's form, is
`dptrain.learners.torch_state`'s.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.data.datasets.base import IGNORE_INDEX
from dptrain.errors import ConfigError, NonFiniteLoss
from dptrain.fingerprint import params_sha256
from dptrain.learners import calibration
from dptrain.learners.calibration import calibration_sums
from dptrain.learners.ema import WeightEma
from dptrain.learners.parallelize import model_blocks, parallelize, replicated_buffers
from dptrain.learners.protocol import Batch, Metrics
from dptrain.learners.schedule import LrSchedule
from dptrain.learners.series_metrics import PREFIX, pop_series_nrmse, series_sums
from dptrain.learners.shard_writer import ShardWriter
from dptrain.learners.torch_config import (
    FP16_DEVICE_TYPES,
    OptimizerFactory,
    Precision,
    SchedulerFactory,
    Strategy,
    Task,
    TorchLearnerConfig,
    resolve_task,
)
from dptrain.learners.torch_state import TorchState
from dptrain.runtime import (
    Runtime,
    all_reduce_flat,
    broadcast_tensors,
    count_collective_seconds,
    get_rank,
    get_world_size,
    is_initialized,
    release_before_shutdown,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The learner


class TorchLearner:
    """The `Learner` for gradient training of a torch module, data-parallel over all ranks.

    Args:
        model: the module; `setup` moves it to the rank's device (and may replace BatchNorm
            layers), so use `learner.module` afterwards rather than this object.
        loss_fn: `loss_fn(outputs, targets)` returning the *mean* loss over the batch (torch's
            default reduction); the learner reports its sum over samples.
        optimizer_factory: called with the parameters after wrapping, e.g.
            `functools.partial(torch.optim.AdamW, lr=1e-3)`. FSDP needs it this late: it
            replaces parameters with sharded DTensors. A factory with a `for_module` method
            (`dptrain.learners.optim.OptimizerSpec`) is called with the module instead, to
            build parameter groups.
        scheduler_factory: called with the optimizer; stepped once per optimizer step. Not
            together with `lr_schedule`, which sets the rate itself.
        per_position: the targets are one class per position of the input window (a language
            model's next tokens): (B, T, C) logits and (B, T) class ids, each position a
            sample of the loss, the error and the calibration.
        activation_checkpointing: recompute each of the model's blocks in the backward instead
            of keeping its activations (torch's `checkpoint_wrapper` on each block: less
            memory, about a third more compute, the same numbers).
        blocks: the model's blocks, the units checkpointed and FSDP-sharded one by one; None:
            those its `shard_units()` returns, if it has that method (`dptrain.models.gpt`'s
            GPT has). `dptrain.learners.parallelize` applies the wrappers.
        Remaining keywords: the fields of `TorchLearnerConfig`.

    Collective calls (every rank, same order): `setup`, `train_step`, `save_sharded`,
    `load_sharded`, and for `strategy="fsdp"` also `eval_step` (parameters are all-gathered in
    forward), `state_dict`, `load_state_dict` and `model_state_dict`.
    """

    uneven_last_batch = False
    """The last global batch of an epoch is padded to equal shards: DDP and FSDP average the
    ranks' gradients of their mean losses, which is the global batch's mean only for equal
    shards, every rank must run forward and backward (a rank without a sample has no mean loss),
    and BatchNorm cannot normalise an empty batch (docs/reference/gradient_learner.md, Another world
    size)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                           torch.Tensor],
                 optimizer_factory: OptimizerFactory, *,
                 scheduler_factory: SchedulerFactory | None = None, strategy: Strategy = "ddp",
                 sync_batchnorm: bool = False, accumulation_steps: int = 1,
                 precision: Precision = "32", max_grad_norm: float | None = None,
                 task: Task = "auto", lr_schedule: LrSchedule | None = None,
                 ema_decay: float = 0.0, ema_every: int = 1, compile: bool = False,
                 per_position: bool = False, activation_checkpointing: bool = False,
                 blocks: Sequence[nn.Module] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn) or not callable(optimizer_factory):
            raise TypeError("loss_fn and optimizer_factory must be callable")
        self.config = TorchLearnerConfig(
            strategy=strategy, sync_batchnorm=sync_batchnorm, precision=precision,
            accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm, task=task,
            lr_schedule=lr_schedule, ema_decay=ema_decay, ema_every=ema_every,
            compile=compile)
        self.blocks = list(blocks) if blocks is not None else model_blocks(model)
        """The model's blocks (`blocks`), or None: it declares none."""
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing and not self.blocks:
            raise ConfigError(f"activation_checkpointing recomputes a model's blocks; "
                              f"{type(model).__name__} declares none (give blocks, or a "
                              f"shard_units() method on the model)")
        #: what train_step calls for the forward: the wrapped module, or its torch.compile
        self._train_forward: Callable[[torch.Tensor], Any] | None = None
        self._compile_checked = False  # the compiled forward has run once
        if lr_schedule is not None and scheduler_factory is not None:
            raise ConfigError("TorchLearner: give lr_schedule or scheduler_factory, not both "
                              "(each would set the learning rate)")
        self.task = resolve_task(loss_fn, self.config.task)
        if per_position and self.task != "classification":
            raise ConfigError("per_position: one class per position is classification; this "
                              "learner's task is regression")
        self.per_position = per_position
        self.loss_fn = loss_fn
        self._module = model
        self._optimizer_factory = optimizer_factory
        self._scheduler_factory = scheduler_factory
        self._wrapped: nn.Module | None = None
        self._released = False  # the wrapper was dropped as the process group shut down
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.device = torch.device("cpu")
        self.num_optimizer_steps = 0
        self.ema: WeightEma | None = None
        self.last_lr: float | None = None
        """The learning rate (first parameter group) of the last optimizer step."""
        self._peak_lrs: list[float] = []
        self._distributed = False
        self._state: TorchState | None = None  # what checkpoints hold, made by setup
        self._replicated_buffers: list[torch.Tensor] = []
        self._last_grad_at = 0.0
        self.calibration: list[dict[str, float]] | None = None  # of the last evaluation

    @classmethod
    def from_config(cls, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                             torch.Tensor],
                    optimizer_factory: OptimizerFactory, config: TorchLearnerConfig, *,
                    scheduler_factory: SchedulerFactory | None = None,
                    **options: Any) -> TorchLearner:
        """`options`: the keywords outside the config (`per_position`,
        `activation_checkpointing`, `blocks`)."""
        # Not asdict: it would turn the schedule into a dict.
        return cls(model, loss_fn, optimizer_factory, scheduler_factory=scheduler_factory,
                   **{f.name: getattr(config, f.name) for f in fields(config)}, **options)

    @property
    def is_sharded(self) -> bool:
        """True for FSDP: checkpoint with `save_sharded`/`load_sharded` on every rank."""
        return self.config.strategy == "fsdp"

    @property
    def eval_is_collective(self) -> bool:
        """True when every rank must call `eval_step` equally often (FSDP over >1 rank); a rank
        with no samples left passes an empty batch."""
        return self.is_sharded and self._distributed

    @property
    def module(self) -> nn.Module:
        """The model being trained (after `setup`: on device, BatchNorm converted, FSDP-sharded
        for strategy="fsdp"); never the DDP wrapper."""
        return self._module

    @property
    def wrapped(self) -> nn.Module:
        """What `train_step` calls: the DDP wrapper, or the module itself (FSDP, world of 1)."""
        return self._require_setup()

    # -- setup --------------------------------------------------------------------------------

    def setup(self, runtime: Runtime) -> None:
        """Move to `runtime.device`, make replicas identical and wrap
        (`dptrain.learners.parallelize`); collective."""
        if self._wrapped is not None:
            raise RuntimeError("TorchLearner.setup() was already called")
        device = runtime.device
        if self.config.precision == "fp16" and device.type not in FP16_DEVICE_TYPES:
            raise ConfigError(f"precision='fp16' needs a CUDA device (float16 autocast with a "
                              f"GradScaler); this rank computes on {device}: use "
                              f"precision='bf16' or '32'")
        self.device = device
        self._distributed = is_initialized() and get_world_size() > 1
        done = parallelize(self._module, blocks=self.blocks, strategy=self.config.strategy,
                           compile=self.config.compile,
                           activation_checkpointing=self.activation_checkpointing,
                           device=device, distributed=self._distributed,
                           sync_batchnorm=self.config.sync_batchnorm)
        module = self._module = done.module
        self._wrapped, self._train_forward = done.wrapped, done.forward
        if self._wrapped is not module:  # a DDP wrapper: see _drop_wrapper
            release_before_shutdown(functools.partial(_drop_wrapper, weakref.ref(self)))
        if self._distributed and not self.is_sharded:
            # DDP all-reduces the gradients inside backward and waits for them at its end: the
            # time from this rank's last gradient to backward's return is time spent on the
            # other ranks (and the transfer), counted as such (dist.collective_seconds).
            for param in module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._grad_ready)
        self._replicated_buffers = replicated_buffers(module)
        self._make_optimizer(module)
        self._state = TorchState(
            module, self.optimizer, strategy=self.config.strategy, scheduler=self.scheduler,
            scaler=self.scaler, ema=self.ema,
            shard_writer=ShardWriter(runtime.timeout)
            if self.is_sharded and self._distributed else None)

    def _make_optimizer(self, module: nn.Module) -> None:
        """The optimizer over the wrapped parameters, and what steps with it: the scheduler,
        the fp16 scaler and the EMA."""
        # Frozen parameters (requires_grad False: --freeze) stay out of the optimizer, as they
        # stay out of DDP's and FSDP's gradient reduction.
        factory = self._optimizer_factory
        self.optimizer = factory.for_module(module) if hasattr(factory, "for_module") \
            else factory([p for p in self._wrapped.parameters() if p.requires_grad])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer_factory must return a torch.optim.Optimizer, got "
                            f"{type(self.optimizer).__name__}")
        # Each group's share of the schedule's rate, from the rates the optimizer was built
        # with (a checkpoint's groups carry the rate of its last step, not these).
        first = self.optimizer.param_groups[0]["lr"]
        self._peak_lrs = [g["lr"] / first if first else 1.0
                          for g in self.optimizer.param_groups]
        if self.config.ema_decay:
            # After wrapping: the replicas are rank 0's by now, so the averages start equal.
            self.ema = WeightEma(module, decay=self.config.ema_decay,
                                 every=self.config.ema_every)
        if self._scheduler_factory is not None:
            self.scheduler = self._scheduler_factory(self.optimizer)
        if self.config.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    def _require_setup(self) -> nn.Module:
        if self._wrapped is None and self._released:
            raise RuntimeError("TorchLearner: its process group was shut down (the end of "
                               "`with distributed()`); use it inside that block")
        if self._wrapped is None:
            raise RuntimeError("call TorchLearner.setup(runtime) before training or checkpoints")
        return self._wrapped

    # -- steps --------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Nothing here depends on the epoch (a schedule is a function of the step)."""

    def step_scalars(self) -> dict[str, float]:
        """The learning rate of the last optimizer step (first parameter group)."""
        return {} if self.last_lr is None else {"lr": self.last_lr}

    def train_step(self, batch: Batch) -> Metrics:
        """One optimizer step on this rank's share of the batch, split into k micro-batches.

        Each micro-batch loss is weighted by its share of the batch, so the accumulated gradient
        is that of the mean loss over the whole batch however unevenly it splits. Returns
        `loss` (sum over samples), `error` or `mse`, and `grad_norm` (pre-clipping,
        count 1) when clipping. Raises `NonFiniteLoss` (a FloatingPointError) on every rank
        before stepping if the loss is not finite on any rank, leaving the parameters untouched
        and identical everywhere.
        """
        wrapped = self._require_setup()
        x, y = self._to_device(_check_batch(batch, allow_empty=False))
        if not self._module.training:  # train() walks every submodule: only after eval
            wrapped.train()
        self.optimizer.zero_grad(set_to_none=True)
        n = x.shape[0]
        k = min(self.config.accumulation_steps, n)
        parts = [(x, y)] if k == 1 else list(zip(x.tensor_split(k), y.tensor_split(k)))
        totals = None
        for i, (xi, yi) in enumerate(parts):
            with self._gradient_sync(is_last=i == k - 1):
                with self._autocast():
                    out = self._forward_for_training(xi)
                    loss = self._loss(out, yi)
                share = xi.shape[0] / n
                self._backward(loss if k == 1 else loss * share)
                if i == k - 1 and self._distributed and not self.is_sharded:
                    count_collective_seconds(max(0.0, time.perf_counter() - self._last_grad_at))
            stats = self._batch_stats(out, loss, yi)
            totals = stats if totals is None else totals + stats
        loss_sum, metric_sum = totals.tolist()  # the step's one host sync
        self._check_finite(loss_sum)
        grad_norm = self._optimizer_step()
        metrics = self._metrics(loss_sum, metric_sum, n, y)
        if grad_norm is not None:
            metrics["grad_norm"] = (grad_norm, 1.0)
        return metrics

    def _forward_for_training(self, x: torch.Tensor) -> Any:
        """The wrapped module's forward, through torch.compile with `compile`; the first call
        that the compiler refuses switches to the eager forward, after one log line."""
        forward = self._train_forward
        assert forward is not None and self._wrapped is not None
        if self._compile_checked or forward is self._wrapped:
            return forward(x)
        try:
            out = forward(x)
        except Exception as err:  # noqa: BLE001 - whatever the tracer or compiler refuses
            first = next((line.strip() for line in str(err).splitlines() if line.strip()),
                         type(err).__name__)
            logger.warning("compile: %s cannot be compiled (%s: %s); training eagerly",
                           type(self._module).__name__, type(err).__name__, first)
            self._train_forward = self._wrapped
            return self._wrapped(x)
        self._compile_checked = True
        return out

    def _check_finite(self, loss_sum: float) -> None:
        """Raise on every rank when any rank's loss is not finite.

        The gradients were already all-reduced in backward, so one rank's NaN is now in every
        rank's gradient: a rank that checked only its own loss would step with it while the
        other stopped, and the replicas would part. One tiny all-reduce tells every rank which
        ranks saw a non-finite loss, and all of them stop at the same step.
        """
        bad = torch.zeros(get_world_size(), dtype=torch.float64)
        bad[get_rank()] = 0.0 if math.isfinite(loss_sum) else 1.0
        if self._distributed:
            all_reduce_flat([bad])
        ranks = [r for r, flag in enumerate(bad.tolist()) if flag]
        if ranks:
            mine = f" (here: {loss_sum})" if get_rank() in ranks else ""
            raise NonFiniteLoss(
                f"train step {self.num_optimizer_steps}: the loss is not finite on rank(s) "
                f"{', '.join(map(str, ranks))}{mine}; no rank updated the parameters. Check the "
                f"inputs for NaN/inf, or lower the learning rate")

    def end_training(self, means: dict[str, float]) -> dict[str, float]:
        return means

    def eval_step(self, batch: Batch) -> Metrics:
        """Metrics of the current model on `batch` under no_grad; changes nothing.

        Local for DDP. For FSDP over several ranks the forward all-gathers parameters, so every
        rank must call it equally often (see `eval_is_collective`); empty batches are allowed.
        """
        self._require_setup()
        series = getattr(batch, "series", None)
        x, y = self._to_device(_check_batch(batch, allow_empty=True))
        metrics = self._evaluate(x, y, series)
        if self.ema is not None:
            with self.ema.swapped_in(self._module):
                averaged = self._evaluate(x, y, series)
            metrics.update({f"ema_{name}": value for name, value in averaged.items()
                            if name in ("loss", "error", "mse") or name.startswith(PREFIX)})
        return metrics

    def _evaluate(self, x: torch.Tensor, y: torch.Tensor, series: torch.Tensor | None = None
                  ) -> Metrics:
        n = x.shape[0]
        if n == 0 and not self.eval_is_collective:
            return self._eval_metrics(0.0, 0.0, 0, y, None)
        self._module.eval()
        with torch.no_grad(), self._autocast():
            out = self._module(x)  # never through DDP: its forward may communicate
            if n == 0:
                return self._eval_metrics(0.0, 0.0, 0, y, None)
            loss_sum, metric_sum = self._batch_stats(out, self._eval_loss(out, y), y).tolist()
        metrics = self._eval_metrics(loss_sum, metric_sum, n, y, out)
        if self.task == "regression" and series is not None:  # windows of several series
            seen = torch.isfinite(y)
            err2 = torch.where(seen, (out.detach().double() - y.double()).square(), 0.0)
            metrics.update(series_sums(err2, seen, series))
        return metrics

    def _eval_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss evaluated: the training loss without label smoothing, whose floor is not
        zero and would make a better model look worse next to another ε."""
        if isinstance(self.loss_fn, nn.CrossEntropyLoss) and self.loss_fn.label_smoothing:
            self._check_regression_shapes(out, y)
            out, y = self._positions_as_samples(out, y)
            return torch.nn.functional.cross_entropy(out, y, weight=self.loss_fn.weight,
                                                     ignore_index=self.loss_fn.ignore_index)
        return self._loss(out, y)

    def _eval_metrics(self, loss_sum: float, metric_sum: float, n: int, y: torch.Tensor,
                      out: torch.Tensor | None) -> Metrics:
        """`_metrics`, plus the calibration bins of softmax(logits) for class labels."""
        metrics = self._metrics(loss_sum, metric_sum, n, y)
        if self.task == "classification" and not y.is_floating_point():
            if out is None:
                metrics.update(calibration_sums(torch.zeros(0, 1), y.new_zeros(0)))
                return metrics
            logits, labels = self._positions_as_samples(out.detach(), y)
            if labels.dim() == 1:
                kept = labels != IGNORE_INDEX
                metrics.update(calibration_sums(logits[kept].float().softmax(1), labels[kept]))
        return metrics

    def _to_device(self, batch: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _gradient_sync(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        """Suppress the gradient all-reduce (DDP) or reduce-scatter (FSDP) on all but the last
        micro-batch; gradients accumulate locally and are reduced once, on the last backward."""
        if not self._distributed:
            return contextlib.nullcontext()
        if self.is_sharded:
            self._wrapped.set_requires_gradient_sync(is_last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if is_last else self._wrapped.no_sync()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.precision == "32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._check_regression_shapes(out, y)
        if self.task == "classification":
            out, y = self._positions_as_samples(out, y)
        return self.loss_fn(out, y)

    def _positions_as_samples(self, out: torch.Tensor, y: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """With `per_position`: logits (B, T, C) and targets (B, T) as the (B * T, C) and
        (B * T,) that a cross-entropy reads; without, both unchanged."""
        if not self.per_position:
            return out, y
        if out.dim() < 3 or out.shape[:-1] != y.shape or y.is_floating_point():
            raise ValueError(f"per_position: expected logits (batch, positions, classes) and "
                             f"class ids (batch, positions), got {tuple(out.shape)} and "
                             f"{tuple(y.shape)} {y.dtype}")
        return out.reshape(-1, out.shape[-1]), y.reshape(-1)

    def _check_regression_shapes(self, out: torch.Tensor, y: torch.Tensor) -> None:
        if self.task == "regression" and out.shape != y.shape:
            raise ValueError(f"regression: model output {tuple(out.shape)} and targets "
                             f"{tuple(y.shape)} differ in shape; the loss would broadcast them")

    def _grad_ready(self, param: torch.Tensor) -> None:
        self._last_grad_at = time.perf_counter()

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _batch_stats(self, out: torch.Tensor, loss: torch.Tensor, y: torch.Tensor
                     ) -> torch.Tensor:
        """(loss summed over samples, or over target positions when a sample has several,
        errors or summed squared error) as float64, detached."""
        out = out.detach()
        if self.task == "classification":
            out, y = self._positions_as_samples(out, y)
            if y.is_floating_point():
                labels, kept = (y.argmax(1) if y.shape == out.shape else y), None
            else:
                labels, kept = y, y != IGNORE_INDEX
            wrong = out.argmax(1) != labels
            if kept is not None:
                wrong &= kept
            metric = wrong.sum().double()
            counted = out.shape[0] if kept is None else kept.sum()
            loss_sum = loss.detach().double() * counted
        else:
            loss_sum = loss.detach().double() * out.shape[0]
            metric = (out.double() - y.double()).square().sum()
        return torch.stack([loss_sum, metric])

    def _metrics(self, loss_sum: float, metric_sum: float, n: int, y: torch.Tensor) -> Metrics:
        if self.task == "classification":
            if y.is_floating_point():  # soft labels (mixup): one per sample
                labels = y.shape[0] * math.prod(y.shape[2:])
                return {"loss": (loss_sum, float(n)), "error": (metric_sum, float(labels))}
            # Class ids, one per sample or one per position: every mean is per counted id.
            counted = float((y != IGNORE_INDEX).sum())
            return {"loss": (loss_sum, counted), "error": (metric_sum, counted)}
        return {"loss": (loss_sum, float(n)), "mse": (metric_sum, float(y.numel()))}

    def _optimizer_step(self) -> float | None:
        """Unscale, clip, step, update the scaler and scheduler; the pre-clip norm if clipping."""
        norm = None
        if self.config.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            total = torch.nn.utils.clip_grad_norm_(self._wrapped.parameters(),
                                                   self.config.max_grad_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self._apply_lr()
        stepped = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # a lowered scale means inf grads: skipped
        else:
            self.optimizer.step()
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        self.num_optimizer_steps += 1
        self._sync_buffers()
        if self.ema is not None:
            self.ema.update(self._module, self.num_optimizer_steps)
        return norm

    def _apply_lr(self) -> None:
        """Set the rate of this step from the schedule (a function of the step count alone,
        which checkpoints hold), so a resumed or resized run applies the same rate."""
        groups = self.optimizer.param_groups
        if self.config.lr_schedule is not None:
            rate = self.config.lr_schedule.lr(self.num_optimizer_steps)
            for group, share in zip(groups, self._peak_lrs):
                group["lr"] = rate * share
        lr = groups[0]["lr"]
        self.last_lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)

    def _sync_buffers(self) -> None:
        """Rank 0's buffers everywhere (plain BatchNorm running stats, ...), so replicas stay
        identical; global-batch BatchNorms are equal already and skipped."""
        if self._distributed and self._replicated_buffers:
            with torch.no_grad():
                broadcast_tensors(self._replicated_buffers)

    # -- state (dptrain.learners.torch_state) ------------------------------------------------

    def _state_after_setup(self) -> TorchState:
        self._require_setup()
        assert self._state is not None
        return self._state

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers as CPU copies under the plain module's names (no `module.`),
        loadable into a non-distributed model of the same architecture. FSDP: collective."""
        return self._state_after_setup().model_state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler and step count, unsharded; live tensors as torch's
        own state_dict gives them (copy them to keep a snapshot). FSDP: collective, and gathers
        the full state on every rank; prefer `save_sharded` there.

        RNG states are not included: the learner owns no generator (dropout and friends draw
        from torch's global one, per rank), so the Trainer saves and restores those per rank.
        """
        return self._state_after_setup().state_dict(self.num_optimizer_steps)

    def ema_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, whole tensors under the plain module's names, loadable like
        `model_state_dict()`'s; FSDP: collective (gathers)."""
        if self.ema is None:
            raise RuntimeError("this learner keeps no EMA (ema_decay=0)")
        return self._state_after_setup().ema_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (every rank, after `setup`). A `module.` prefix on
        model keys (a DDP-wrapped torch checkpoint) is accepted."""
        self.num_optimizer_steps = self._state_after_setup().load_state_dict(state)

    def save_sharded(self, path: str | os.PathLike) -> None:
        """Write a torch.distributed.checkpoint (DCP) directory: each rank writes its own shards.
        Collective. Loads on any world size with `load_sharded`. The directory should be new;
        making it appear atomically (temp name, rename, marker) is the caller's job."""
        self._state_after_setup().save_sharded(path, self.num_optimizer_steps)

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Read a `save_sharded` directory, resharding to this world size; collective."""
        self.num_optimizer_steps = self._state_after_setup().load_sharded(path)

    # -- the Trainer's hooks ------------------------------------------------------------------

    def end_evaluation(self, means: dict[str, float], part: str = "test") -> dict[str, float]:
        means, self.calibration = calibration.end_evaluation(means)
        return pop_series_nrmse(pop_series_nrmse(means, part), part, "ema_")

    def save_checkpoint(self, directory: Path, *, background: bool = False) -> dict[str, Any]:
        """DDP: the state, for rank 0's state file. FSDP: every rank writes its shards to
        `directory`/sharded (a filesystem every rank shares) and the state file holds none.
        With `background` (FSDP over more than one rank), each rank copies its shards to memory
        here and a thread writes them; `checkpoint_written` waits for them. One process holds
        the whole model and no group to write with: it writes here."""
        return self._state_after_setup().save_checkpoint(directory, self.num_optimizer_steps,
                                                         background=background)

    def checkpoint_written(self) -> None:
        """Block until the shards of the last background `save_checkpoint` are on disk, on
        every rank; raise `CheckpointError` if a rank could not write them."""
        if self._state is not None:
            self._state.checkpoint_written()

    def load_checkpoint(self, state: dict[str, Any], directory: Path) -> None:
        self.num_optimizer_steps = self._state_after_setup().load_checkpoint(state, directory)

    @property
    def run_record(self) -> dict[str, Any]:
        """A sharded checkpoint cannot be resumed by a replicated learner, nor the reverse."""
        return {"sharded_checkpoint": self.is_sharded}

    def flops_per_token(self) -> tuple[float, torch.dtype] | None:
        """The module's own `flops_per_token` (a method or a number; `dptrain.models.gpt`
        has one) and the dtype of its products: autocast's, else its parameters'."""
        found = getattr(self._module, "flops_per_token", None)
        value = found() if callable(found) else found
        if not value:
            return None
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.config.precision)
        params = next(iter(self._module.parameters()), None)
        return float(value), autocast or (params.dtype if params is not None else torch.float32)

    def report(self, out_dir: Path | None, split: Any) -> dict[str, Any]:
        """The calibration bins (classification), rank 0 draws reliability.png; with EMA the
        averaged weights' fingerprint (`ema_sha256`, collective under FSDP)."""
        out = calibration.report(out_dir, self.calibration)
        if self.ema is not None:
            out["ema_sha256"] = params_sha256(self.ema_state_dict())
        return out


def _drop_wrapper(learner_ref: weakref.ref) -> None:
    """When the process group shuts down, just before it is destroyed: drop the learner's DDP
    wrapper, so its reducer goes before the group it holds rather than in interpreter teardown,
    where torch 2.13 aborted finished jobs now and then ("terminate called without an active
    exception"; 5 in 30 two-rank runs of examples/torch_toy_mlp.py under mpirun with the wrapper
    left to teardown). The rarer abort left after this (2 in 160 runs) had another cause: see
    dist.group._let_collective_threads_finish."""
    learner = learner_ref()
    if learner is not None:
        # the training forward is the wrapper too, or its compiled twin that holds it
        learner._wrapped = learner._train_forward = None
        learner._released = True
        gc.collect()


def _check_batch(batch: Any, *, allow_empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"a batch must be a pair (inputs, targets), got {type(batch).__name__}"
                        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}")
    x, y = batch
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"inputs and targets must be tensors, got {type(x).__name__} and "
                        f"{type(y).__name__}")
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(f"inputs and targets must hold the same number of samples (dim 0), got "
                         f"shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError("train_step got an empty batch; every rank needs at least one sample "
                         "per step")
    return x, y
