"""Trainer: epochs or steps over sharded data, exact evaluation, atomic checkpoints with exact
resume.

The Trainer drives any `Learner` (dptrain.learners.protocol) and knows nothing about TAGI or
autograd. Every rank runs `fit()`; collectives happen inside the learner's `train_step`, in the
metric reduction at each epoch end and validation point, and around checkpoints.

Steps are the run's clock (docs/howto/checkpoints.md, Steps and validation points): a run ends
after `num_epochs` epochs or at global step `max_steps` (mid-epoch if so: epochs are then a view
of steps), and validates at each epoch end or, with `val_every`, every that many steps and at
its end. Each validation point is a row of steps.csv (when the run counts steps) and a chance
for best/ and early stopping; with `val_every` each also writes a checkpoint, so that best/ can
hold it and a resumed run never validates a point twice.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dptrain import runtime as dd
from dptrain.data import (
    ShardedSampler,
    Split,
    num_samples_per_rank,
    steps_per_epoch,
    world_sizes_dividing,
)
from dptrain.data.datasets.base import Batch as LoadedBatch
from dptrain.data.datasets.holdout import subset
from dptrain.data.datasets.vocabulary import FILE_NAME as VOCABULARY_FILE
from dptrain.data.loader import BatchLoader, fetch_batch
from dptrain.data.mixing import Mixing
from dptrain.errors import ConfigError, RankFailure
from dptrain.fingerprint import params_sha256
from dptrain.learners.protocol import Batch, Learner, Metrics
from dptrain.runtime.collectives import as_rank_failure
from dptrain.train import checkpoint as ckpt
from dptrain.train import faults, flops, loggers, resume, rng, steps
from dptrain.train.early_stopping import EarlyStopping
from dptrain.train.faults import FailAt
from dptrain.train.progress import Progress
from dptrain.train.stragglers import StepTimes
from dptrain.train.writer import BackgroundWriter, snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train; every field is stored in each checkpoint and in summary.json."""

    out_dir: Path
    """Run directory: checkpoints/, epochs.csv, tb/, plots, summary.json."""
    num_epochs: int = 10
    global_batch_size: int = 32
    """Samples of one step over all ranks; each rank takes global_batch_size / world_size of
    them (its local batch). Because rank r takes every world_size-th index of one shared
    permutation, the global batch of step k is the same samples at any world size (up to the
    wrap-around padding of an epoch's last step, for a learner that needs equal shards), and a
    run resumes on any world size that divides it, mid-epoch included."""
    seed: int = 0
    """Seeds the data order and every RNG (rank r draws from seed + r)."""
    checkpoint_every: int | None = None
    """Also checkpoint every this many steps (one is always written at each epoch end)."""
    keep_last: int = 3
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest valid checkpoint in out_dir, if any."""
    monitor: str = ""
    """The metric that chooses the best epoch (best/) and stops early; empty: the task's
    validation metric (val_error, val_rmse, val_series_nrmse for several time series) when
    the split has a validation part, else
    nothing is chosen (no best/, no early stopping). Validation chooses, test reports: a
    test_* metric here chooses on the data the run reports on (docs/design.md)."""
    monitor_mode: Literal["min", "max"] = "min"
    patience: int | None = None
    """Stop after this many epochs without a better monitored value (None: never); needs a
    monitored metric."""
    eval_batch_size: int = 512
    workers: int = 0
    """DataLoader worker processes per rank that decode batches ahead of the step (0: the
    training process makes each batch when it needs it). Never changes a result."""
    progress: bool = True
    async_checkpoints: bool = True
    """Write checkpoints in a background thread: training pauses only to copy the state to
    memory (dptrain.train.writer). False: write and publish before the next step."""
    fail_at: FailAt | None = None
    mixing: Mixing | None = None
    """Mixup/cutmix of the training batches (`dptrain.data.mixing`): partners and weights
    from (seed, epoch, global position), the same on any world size."""
    max_steps: int | None = None
    """End the run at this global (optimizer) step, mid-epoch if so, instead of after
    num_epochs epochs (then not used)."""
    val_every: int | None = None
    """Validate every this many global steps, and at the run's end, instead of at each epoch
    end; best/ and early stopping (patience in validation points) follow these points, and each
    writes a checkpoint. The test part is evaluated at the end only."""
    val_batches: int | None = None
    """Validate on this many global batches (global_batch_size samples each) of the validation
    part: a seeded choice over the whole part, the same at every point and on every world size
    (`dptrain.train.steps.validation_indices`); None: all of it."""
    peak_flops: float | None = None
    """FLOP/s of one device for the model FLOPs utilisation (mfu); None: the CUDA device's from
    a table, or measured on this CPU at the start. Only for a model that declares its
    flops_per_token."""
    record: dict[str, Any] = field(default_factory=dict)
    """What built this run (the CLI's options), stored for the record."""
    run_record: dict[str, Any] = field(default_factory=dict)
    """The options that define this run (JSON values: model and its sizes, data, learner
    options...). Each checkpoint stores them with the Trainer's own (batch size, seed, the
    model's parameter names and shapes); resuming from a checkpoint whose record differs is
    refused, naming each difference, before anything is loaded: one run per directory. Leave
    out what may change on resume (epochs, patience, ...)."""

    def __post_init__(self) -> None:
        for name in ("num_epochs", "global_batch_size", "keep_last", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1 step, got {self.checkpoint_every}")
        for name in ("max_steps", "val_every", "val_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 (or None), got {value}")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ConfigError(f"peak_flops must be > 0 FLOP/s (or None), got {self.peak_flops}")
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"resume must be 'auto' or 'never', got {self.resume!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["fail_at"] = None if self.fail_at is None else str(self.fail_at)
        return out


def _derived(means: dict[str, float], prefix: str, unit: str | None = None) -> dict[str, float]:
    """`{prefix}_{name}` per metric, plus rmse from mse (and ema_rmse from ema_mse); for token
    data (`unit`: what one token is) perplexity and bits per unit from the per-token loss."""
    out = {f"{prefix}_{k}": v for k, v in means.items()}
    for name in ("mse", "ema_mse"):
        if name in means:
            out[f"{prefix}_{name[:-3]}rmse"] = math.sqrt(means[name])
    if unit is not None:
        out.update(steps.language_metrics(means, prefix, unit))
    return out


def metric_names(reported: Iterable[str], prefix: str, unit: str | None = None) -> list[str]:
    """The columns of epochs.csv that metrics reported as `reported` become (`train`, `val`
    or `test` prefix, rmse from mse, perplexity and bits per `unit` for token data)."""
    return list(_derived(dict.fromkeys(reported, 0.0), prefix, unit))


def default_monitor(task: str, has_validation: bool, token_data: bool = False,
                    multi_series: bool = False) -> str:
    """The metric that chooses when none is named: the validation loss (token data: nats per
    token), error (classification) or RMSE (regression; windows of several time series: the
    per-series-balanced `val_series_nrmse`, which one odd series cannot capture,
    `dptrain.learners.series_metrics`); "" (nothing chosen) without a validation part."""
    if not has_validation:
        return ""
    if token_data:
        return "val_loss"
    if task == "classification":
        return "val_error"
    return "val_series_nrmse" if multi_series else "val_rmse"


def split_monitor(split: Split) -> str:
    """`default_monitor` of `split`."""
    return default_monitor(split.task, split.validation is not None,
                           split.vocabulary is not None,
                           split.series is not None and len(split.series.names) > 1)


def _add(sums: Metrics, metrics: Metrics) -> None:
    """Add a step's (sum, count) per metric to `sums`, in place."""
    for name, (s, c) in metrics.items():
        total_s, total_c = sums.get(name, (0.0, 0.0))
        sums[name] = (total_s + s, total_c + c)


def _pause_stats(pauses: list[float]) -> dict[str, float | int]:
    """How long checkpoints held training up on this rank: count, mean and longest, seconds."""
    if not pauses:
        return {"count": 0, "mean": 0.0, "max": 0.0}
    return {"count": len(pauses), "mean": sum(pauses) / len(pauses), "max": max(pauses)}


class Trainer:
    """Fit a learner on a split, data-parallel over the ranks of `runtime`."""

    def __init__(self, learner: Learner, split: Split, config: TrainConfig,
                 runtime: dd.Runtime) -> None:
        self.learner, self.split, self.config, self.runtime = learner, split, config, runtime
        self.rank, self.world_size = runtime.env.rank, runtime.env.world_size
        if config.global_batch_size % self.world_size:
            works = ", ".join(map(str, world_sizes_dividing(config.global_batch_size)))
            raise ConfigError(f"global_batch_size {config.global_batch_size} must be divisible "
                              f"by the world size {self.world_size}: every rank takes an equal "
                              f"share; world sizes that work: {works}")
        self.local_batch_size = config.global_batch_size // self.world_size
        # The learner says whether it takes unequal shards; padding them equal would make the
        # epoch's last step depend on the world size (docs/design.md, The Learner protocol).
        self.sampler = ShardedSampler(split.train, rank=self.rank, world_size=self.world_size,
                                      seed=config.seed, mode="train",
                                      uneven_last_batch=learner.uneven_last_batch)
        pin = runtime.device.type == "cuda"
        self.loader = BatchLoader(split.train, self.sampler, self.local_batch_size,
                                  workers=config.workers, pin_memory=pin, mixing=config.mixing)
        self.steps_per_epoch = steps_per_epoch(len(split.train), self.world_size,
                                               self.local_batch_size)
        """Global steps of one epoch: ceil(training samples / global batch), any world size."""
        self.unit = split.vocabulary.unit if split.vocabulary is not None else None
        """Token data: what one token is (character, byte, token), for bits per unit."""
        self.tokens_per_sample = self._tokens_per_sample()
        # Each evaluated part, validation first: the test part's evaluation is the learner's
        # last of the epoch (its calibration bins are the test part's in the summary).
        # A split without a test part of its own (token data) names its validation part as
        # the test part; it is evaluated once, as validation, and no test_* figure is made up.
        test = split.test if split.test is not split.validation else None
        self.eval_parts = {prefix: self._eval_part(dataset) for prefix, dataset in
                           (("val", self._validation_part()), ("test", test))
                           if dataset is not None}
        self.data_wait_s = 0.0
        """Seconds the training steps waited for their batches (not the evaluations)."""
        self.step_times = StepTimes(self.rank, self.world_size, self._metric_device())
        """Per-rank compute, wait and data time of the steps (ranks.csv; slow ranks named)."""
        self.train_s = 0.0
        self.paused_s = 0.0
        """Seconds of the current epoch spent in validation points and mid-epoch checkpoints."""
        """Seconds spent training (waits for batches included; evaluations and checkpoints not)."""
        self.monitor = config.monitor or split_monitor(split)
        if config.patience is not None and not self.monitor:
            raise ConfigError(f"patience {config.patience} needs a metric to monitor, and "
                              f"{split.name} has no validation part: give the split one "
                              f"(dptrain.data.datasets.holdout.hold_out) or name a monitor")
        self.early = EarlyStopping(self.monitor, mode=config.monitor_mode,
                                   patience=config.patience)
        self.ckpt_dir = Path(config.out_dir) / "checkpoints"
        self._writer = BackgroundWriter(enabled=config.async_checkpoints)
        self.checkpoint_pauses: list[float] = []
        """Seconds each checkpoint held this rank's training up (the write excluded when it
        runs in the background)."""
        self.history: list[dict[str, Any]] = []
        self.epoch, self.step = 0, 0
        self.tb: loggers.TensorBoardLogger | None = None
        self._layout = ""
        self._step_scalars: dict[str, float] = {}
        """The learner's per-step values (learning rate) of the last step: epochs.csv's."""
        self._epoch_sums: Metrics = {}
        """This rank's (sum, count) per train metric so far in the current epoch; saved in
        mid-epoch checkpoints so a resumed epoch reports the metrics of all its steps."""
        self._point_sums: Metrics = {}
        """This rank's (sum, count) per train metric since the last validation point (steps.csv's
        train columns); saved in every checkpoint, like `_epoch_sums`."""
        self.step_history: list[dict[str, Any]] = []
        """One row per validation point (steps.csv)."""
        self.best_step: int | None = None
        """The global step of the validation point best/ holds."""
        self._best_pending = False
        """A validation point at an epoch's last step (or the run's) was the best: the
        checkpoint written there right after it becomes best/."""
        self.throughput: dict[str, Any] = {}
        """The model's FLOPs per token and the devices' peak (MFU), set at the start."""

    @property
    def counts_steps(self) -> bool:
        """Whether the run is counted in steps (max_steps or val_every): it writes steps.csv."""
        return self.config.max_steps is not None or self.config.val_every is not None

    def _tokens_per_sample(self) -> int | None:
        """Token data: the target positions of one sample (a window's length); else None."""
        if self.split.vocabulary is None:
            return None
        _, y = fetch_batch(self.split.train, 0, torch.arange(1))
        return max(1, y[0].numel())

    def _validation_part(self) -> Any:
        """The validation part, or its `val_batches` global batches (the same samples at every
        validation point, on every rank and world size)."""
        dataset = self.split.validation
        if dataset is None or self.config.val_batches is None:
            return dataset
        chosen = steps.validation_indices(len(dataset), batches=self.config.val_batches,
                                          batch_size=self.config.global_batch_size,
                                          seed=self.config.seed)
        return dataset if chosen is None else subset(dataset, chosen)

    @property
    def eval_sampler(self) -> ShardedSampler:
        """The test part's sampler (this rank's share of the test samples)."""
        return self.eval_parts["test"][0]

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to the last epoch or max_steps (or an early stop) and return the summary (also
        summary.json). The data loaders' worker processes and the checkpoint writer's thread
        end with it, however it ends."""
        try:
            return self._fit()
        except BaseException as raised:
            failure = as_rank_failure(raised)
            if isinstance(failure, RankFailure) and failure.step is None:
                failure.step = self.step  # the launcher's one line names it
            # The write in flight is of a good state (a peer failing later does not change
            # it): let it land, so a restart loses less; its own error would hide this one.
            try:
                self._writer.wait()
            except BaseException as err:  # noqa: BLE001
                log.warning("the checkpoint being written when the run failed was lost: %s",
                            err)
            if failure is raised:
                raise
            raise failure from raised
        finally:
            self._writer.close()
            self.loader.close()
            for _, loader in self.eval_parts.values():
                loader.close()

    def _fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        rng.seed_everything(self.config.seed + self.rank)
        self.learner.setup(self.runtime)
        # Collective for sharded learners (the full state is gathered), so every rank does it.
        self._layout = resume.parameter_layout(self.learner.model_state_dict())
        resumed_from = self._maybe_resume()
        if self.rank == 0:
            Path(self.config.out_dir).mkdir(parents=True, exist_ok=True)
            self.tb = loggers.TensorBoardLogger(Path(self.config.out_dir) / "tb")
            if self.split.vocabulary is not None:  # generate, init-from and load_run read it
                self.split.vocabulary.save(Path(self.config.out_dir) / VOCABULARY_FILE)
        self.throughput = self._throughput_setup()
        samples_seen = 0
        while not self._run_over():
            self.sampler.set_epoch(self.epoch)
            # per-epoch schedules (TAGI σ_v), and augmentation draws through the loader, are
            # functions of the epoch, so a resumed run continues them exactly
            self.learner.set_epoch(self.epoch)
            epoch_start, self.paused_s = time.perf_counter(), 0.0
            seen = self._train_epoch()
            self.train_s += time.perf_counter() - epoch_start - self.paused_s
            samples_seen += seen
            # The epoch ends here, or the run in it (max_steps, or an early stop at a point).
            epoch_complete = self.sampler.num_remaining == 0
            last = self._stopped() or (epoch_complete and self.config.max_steps is None
                                       and self.epoch + 1 >= self.config.num_epochs)
            train_means = self._epoch_means(clear=epoch_complete)
            improved = self._end_epoch(train_means, self._epoch_evaluation(last), last)
            self._log_step_times()
            self._save_checkpoint(epoch_done=epoch_complete, is_best=improved)
            if epoch_complete:
                self.epoch += 1
            if last:
                break
        # The last checkpoint is published before the run says it is done, on every rank (a
        # caller may look for it as soon as fit() returns, on any rank).
        self._writer.wait()
        dd.barrier()
        summary = self._summary(time.perf_counter() - start, samples_seen, resumed_from)
        self._finish(summary)
        return summary

    def _stopped(self) -> bool:
        """The run ends at this step: max_steps reached, or early stopping said so."""
        return self.early.should_stop or (self.config.max_steps is not None
                                          and self.step >= self.config.max_steps)

    def _run_over(self) -> bool:
        """Nothing is left to train (a run resumed from its last checkpoint included)."""
        return self._stopped() or (self.config.max_steps is None
                                   and self.epoch >= self.config.num_epochs)

    def _train_epoch(self) -> int:
        """Steps to the epoch's end, to max_steps, or to an early stop at a validation point;
        the samples this run trained on, over every rank."""
        seen = 0
        total = self.sampler.num_batches(self.local_batch_size)
        done = self.sampler.position // self.local_batch_size
        if self.config.max_steps is not None:
            total = min(total, done + self.config.max_steps - self.step)
        progress = Progress(total=total, done=done, desc=self._progress_label(),
                            enabled=self.config.progress and self.rank == 0,
                            tokens_per_sample=self.tokens_per_sample,
                            mfu_per_token=self.throughput.get("mfu_per_token"))
        batches = iter(self.loader)
        while not self._stopped():
            waited = time.perf_counter()
            batch = next(batches, None)
            fetched = time.perf_counter() - waited
            self.data_wait_s += fetched
            if batch is None:
                break
            self._maybe_fail()
            self.step_times.begin_step()
            metrics = self.learner.train_step(self._to_device(batch))
            self.step += 1
            self._step_scalars = self.learner.step_scalars()
            if self.tb is not None and self._step_scalars:
                self.tb.log_step(self._step_scalars, self.step)
            self.step_times.end_step(self.step, fetched)
            seen += len(batch[1])
            # The sums (empty, or restored from a checkpoint) of the epoch, and since the last
            # validation point for a run counted in steps (steps.csv); a point empties the latter.
            _add(self._epoch_sums, metrics)
            if self.counts_steps:
                _add(self._point_sums, metrics)
            progress.update(len(batch[1]) * self.world_size, metrics)
            self._after_step()
        progress.close()
        # The ranks' own counts: an uneven last step holds fewer than world size x rank 0's.
        return sum(dd.all_gather_object(seen))

    def _after_step(self) -> None:
        """A validation point (`val_every`), else a `checkpoint_every` checkpoint, when due.
        Either is written mid-epoch only: the epoch's or the run's end writes its own next."""
        config, step = self.config, self.step
        began = time.perf_counter()
        try:
            self._point_or_checkpoint(config, step)
        finally:
            # Out of the training time, as the evaluations and checkpoints at an epoch's end.
            self.paused_s += time.perf_counter() - began

    def _point_or_checkpoint(self, config: TrainConfig, step: int) -> None:
        ends_here = self.sampler.num_remaining == 0 or (config.max_steps is not None
                                                        and step >= config.max_steps)
        if config.val_every and step % config.val_every == 0:
            improved = self._validation_point()
            if ends_here or self.early.should_stop:
                self._best_pending |= improved  # the checkpoint coming next holds this point
            else:
                self._save_checkpoint(epoch_done=False, is_best=improved)
        elif config.checkpoint_every and step % config.checkpoint_every == 0 and not ends_here:
            self._save_checkpoint(epoch_done=False)

    def _samples_seen(self) -> int:
        return steps.samples_seen(self.step, steps_per_epoch=self.steps_per_epoch,
                                  global_batch_size=self.config.global_batch_size,
                                  num_samples=len(self.split.train))

    def _progress_label(self) -> str:
        if self.config.max_steps is not None:
            return f"epoch {self.epoch + 1}, step {self.step}/{self.config.max_steps}"
        return f"epoch {self.epoch + 1}/{self.config.num_epochs}"

    def _epoch_means(self, *, clear: bool) -> dict[str, float]:
        """Collective: the train metrics of the epoch's steps so far, over every rank; the sums
        are kept for a mid-epoch checkpoint unless the epoch is over (`clear`)."""
        sums = self._epoch_sums
        if clear:
            self._epoch_sums = {}
        means = dd.means(dd.reduce_sum_count(sums, self._metric_device()))
        return _derived(self.learner.end_training(means), "train", self.unit)

    def _epoch_evaluation(self, last: bool) -> dict[str, dict[str, float]]:
        """The parts evaluated at this epoch end: every part, or with `val_every` (whose
        validation points are the steps) only at the run's end: the last point's validation,
        after one at this step if the last was earlier, and the test part."""
        if not self.config.val_every:
            return {name: self._evaluate(name) for name in self.eval_parts}
        if not last:
            return {}
        if not self.step_history or self.step_history[-1]["step"] != self.step:
            self._best_pending |= self._validation_point()
        row = self.step_history[-1]
        evaluated = {"val": {k: v for k, v in row.items() if k.startswith("val_")}}
        if "test" in self.eval_parts:
            evaluated["test"] = self._evaluate("test")
        return evaluated

    def _validation_point(self, evaluated: dict[str, float] | None = None) -> bool:
        """Collective: a row of steps.csv (train metrics since the last point, validation at
        this step); with `val_every`, best/ and early stopping look at it. True when it is the
        new best. `evaluated`: the validation an epoch end just made (no second one)."""
        if evaluated is None:
            evaluated = self._evaluate("val") if "val" in self.eval_parts else {}
        sums, self._point_sums = self._point_sums, {}
        means = dd.means(dd.reduce_sum_count(sums, self._metric_device()))
        since = {k: v for k, v in _derived(means, "train", self.unit).items()
                 if not k.startswith("train__")}
        seen = self._samples_seen()
        row: dict[str, Any] = {"step": self.step,
                               "epoch": round(self.step / self.steps_per_epoch, 6),
                               "samples": seen}
        if self.tokens_per_sample is not None:
            row["tokens"] = seen * self.tokens_per_sample
        row.update({**self._step_scalars, **since, **evaluated})
        self.step_history.append(row)
        improved = False
        if self.config.val_every:
            improved = self.early.update(self.epoch + 1, row)
        if improved:
            self.best_step = self.step
        if self.rank == 0:
            loggers.write_csv(Path(self.config.out_dir) / "steps.csv", self.step_history)
            if self.tb is not None:  # against the step, beside the learning rate
                self.tb.log_step({k: v for k, v in row.items()
                                  if k.startswith(("train_", "val_"))}, self.step)
            if self.config.val_every:
                shown = "  ".join(f"{k} {v:.4g}" for k, v in row.items()
                                  if k not in ("step", "epoch", "samples", "tokens"))
                end = f"/{self.config.max_steps}" if self.config.max_steps else ""
                dd.rank_zero_print(f"step {self.step}{end} (epoch {row['epoch']:.4g})  {shown}")
        return improved

    def _eval_part(self, dataset: Any) -> tuple[ShardedSampler, BatchLoader]:
        sampler = ShardedSampler(dataset, rank=self.rank, world_size=self.world_size,
                                 mode="eval")
        return sampler, BatchLoader(dataset, sampler, self.config.eval_batch_size,
                                    workers=self.config.workers,
                                    pin_memory=self.runtime.device.type == "cuda")

    def _evaluate(self, part: str = "test") -> dict[str, float]:
        """Every sample of `part` ("val" or "test") exactly once over the ranks (contract 5),
        reduced as sums; the metrics come `part`-prefixed."""
        sums: Metrics = {}
        sampler, loader = self.eval_parts[part]
        dataset = loader.dataset
        sampler.set_position(0)
        batches: Iterable[Batch] = loader
        if self.learner.eval_is_collective:
            # A sharded model all-gathers its weights inside every eval step, so every rank
            # must take as many steps as rank 0 (which holds the most samples): pad with
            # empty batches, which count nothing.
            most = num_samples_per_rank(len(dataset), self.world_size, 0, mode="eval")
            padding = math.ceil(most / self.config.eval_batch_size) - len(loader)
            empty = torch.zeros(0, dtype=torch.long)
            batches = itertools.chain(batches, (fetch_batch(dataset, 0, empty)
                                                for _ in range(padding)))
        for batch in batches:
            for name, (s, c) in self.learner.eval_step(self._to_device(batch)).items():
                total = sums.get(name, (0.0, 0.0))
                sums[name] = (total[0] + s, total[1] + c)
        means = dd.means(dd.reduce_sum_count(sums, self._metric_device()))
        return _derived(self.learner.end_evaluation(means, part), part, self.unit)

    def _end_epoch(self, train_means: dict[str, float],
                   evaluated: dict[str, dict[str, float]], last: bool) -> bool:
        """The epoch's row of epochs.csv (an epoch the run ends in counts as one, and a later
        run that goes on replaces its row); without `val_every` its validation is a point that
        chooses. True when the checkpoint written next becomes best/."""
        record = {"epoch": self.epoch + 1, "step": self.step, **self._step_scalars,
                  **train_means, **{k: v for means in evaluated.values() for k, v in means.items()}}
        self.history = [row for row in self.history if row["epoch"] != self.epoch + 1]
        self.history.append(record)
        if self.config.val_every:
            improved, self._best_pending = self._best_pending, False
        else:
            improved = self.early.update(self.epoch + 1, record)
            if improved:
                self.best_step = self.step
            if self.counts_steps:
                self._validation_point(evaluated.get("val", {}))
        if self.rank == 0:
            loggers.write_csv(Path(self.config.out_dir) / "epochs.csv", self.history)
            if self.tb is not None:
                self.tb.log(record)
            shown = "  ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "epoch")
            of = "" if self.config.max_steps is not None else f"/{self.config.num_epochs}"
            dd.rank_zero_print(f"epoch {self.epoch + 1}{of}  {shown}")
        return improved

    def _log_step_times(self) -> None:
        """Collective: every rank's mean step times of the epoch to ranks.csv and TensorBoard
        (not epochs.csv, which must not change from run to run: dptrain.train.stragglers)."""
        rows = self.step_times.epoch_rows(self.epoch + 1)
        if self.rank != 0:
            return
        loggers.write_rank_times(Path(self.config.out_dir) / "ranks.csv", rows)
        if self.tb is not None:
            self.tb.log({"epoch": self.epoch + 1, "step": self.step,
                         **{f"ranks_{part}_s_rank{row['rank']}": row[f"{part}_s"]
                            for row in rows for part in ("compute", "wait", "data")}})

    # ------------------------------------------------------------------------------ helpers
    def _metric_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo takes CPU ones.
        return self.runtime.device if self.runtime.backend == "nccl" else torch.device("cpu")

    def _to_device(self, batch: Batch) -> Batch:
        x, y = batch
        device = self.runtime.device
        moved = LoadedBatch((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
        moved.series = getattr(batch, "series", None)  # stays on the CPU: it only counts
        return moved

    # -------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, *, epoch_done: bool, is_best: bool = False) -> None:
        """Collective: every rank contributes its RNG state and its learner part; rank 0 copies
        the state to memory and writes it in the background (`TrainConfig.async_checkpoints`),
        publishing it atomically. A sharded learner's ranks copy their shards to memory here
        and write them in the background too (torch.distributed.checkpoint); rank 0 checksums
        and publishes the folder once every rank's shards are on disk."""
        started = time.perf_counter()
        if self.tb is not None:
            self.tb.flush()  # the steps before this checkpoint, which a resume will not log
        rng_states = dd.all_gather_object(rng.capture())
        fail_at, step = self.config.fail_at, self.step  # the thread runs after steps moved on
        midway = None if fail_at is None else \
            (lambda: fail_at.maybe_kill_in_checkpoint(self.rank, step))
        if self.rank != 0 and midway is not None:
            midway()  # while rank 0 writes
        # Summed in the same order as an uninterrupted run, the epoch's metrics come out equal.
        partial_sums = dd.all_gather_object({} if epoch_done else dict(self._epoch_sums))
        # Since the last validation point, which need not be an epoch end (steps.csv).
        point_sums = dd.all_gather_object(dict(self._point_sums)) if self.counts_steps else None
        # One write in flight at most, on every rank (a sharded learner's ranks each write
        # theirs); rank 0's must be done before `begin`, as its pruning removes stale
        # temporary folders.
        self._writer.wait()
        tmp = ckpt.begin(self.ckpt_dir, self.step) if self.rank == 0 else None
        tmp = Path(dd.broadcast_object(str(tmp)))
        learner_state = self.learner.save_checkpoint(
            tmp, background=self.config.async_checkpoints)
        if self.rank == 0:
            record = self._run_record()
            # Copies taken now: the live tensors change in the next steps, while the thread
            # writes. Everything else is copied too, the history list included.
            state = snapshot({"learner": learner_state,
                              "sampler": self.sampler.state_dict(), "rng": rng_states,
                              "early_stopping": self.early.state_dict(),
                              "history": self.history,
                              "trainer": {"epoch": self.epoch, "step": self.step,
                                          "epoch_done": epoch_done,
                                          "partial_sums": partial_sums,
                                          **self._step_state(point_sums)}})
            meta = {"step": self.step, "epoch": self.epoch, "epoch_done": epoch_done,
                    "world_size": self.world_size, "config": self.config.to_json(),
                    "run_record": record, "sharded": record.get("sharded_checkpoint", False),
                    "saved_at": time.time()}
            self._writer.submit(lambda: self._publish(tmp, state, meta, is_best, midway))
        else:
            # This rank's own files (its shards), finished in its writer's thread, so that the
            # next checkpoint and the run's end wait for them as rank 0's wait for its write.
            self._writer.submit(self.learner.checkpoint_written)
        if not self.config.async_checkpoints:
            dd.barrier()  # nobody runs ahead (or is killed) before the checkpoint is published
        self.checkpoint_pauses.append(time.perf_counter() - started)

    def _step_state(self, point_sums: list[dict[str, Any]] | None) -> dict[str, Any]:
        """What a run counted in steps adds to a checkpoint: the validation points so far, the
        best one's step and every rank's train sums since the last point. Nothing for a run
        in epochs, whose checkpoints stay as they were."""
        if point_sums is None:
            return {}
        return {"step_history": self.step_history, "best_step": self.best_step,
                "point_sums": point_sums}

    def _publish(self, tmp: Path, state: dict[str, Any], meta: dict[str, Any], is_best: bool,
                 midway: Any) -> None:
        """Rank 0, in the writer's thread: wait for every rank's files, write, fsync, publish,
        copy as best, prune."""
        # Raises if a rank could not write its shards: then nothing is published.
        self.learner.checkpoint_written()
        final = ckpt.commit(tmp, state, meta, midway=midway)
        if is_best:
            ckpt.copy_as_best(final, self.ckpt_dir)
        ckpt.prune(self.ckpt_dir, self.config.keep_last)

    def _maybe_fail(self) -> None:
        """Fault injection before the step about to run (`--fail-at RANK:STEP`)."""
        fail_at = self.config.fail_at
        if fail_at is None:
            return
        if fail_at.kill_due(self.step):
            # A simulated crash comes once the job's checkpoints so far are on disk (every rank
            # knows the point, so all wait here together): the next attempt resumes from the
            # newest one, as it did with synchronous checkpoints. Crashes during a write are
            # the RANK:ckpt:STEP points.
            self._writer.wait()
            dd.barrier()
        fail_at.maybe_kill(self.rank, self.step)

    def _run_record(self) -> dict[str, Any]:
        """What defines this run: the Trainer's own part, the learner's and the caller's."""
        return resume.as_json({"batch_size": self.config.global_batch_size,
                               "seed": self.config.seed, **self.learner.run_record,
                               resume.LAYOUT_KEY: self._layout, **self.config.run_record})

    def _maybe_resume(self) -> str | None:
        """Continue from the newest valid checkpoint any node holds, if any; collective."""
        run_dir, local_rank = Path(self.config.out_dir), self.runtime.env.local_rank
        if self.config.resume == "never":
            resume.refuse_if_any(run_dir, self.ckpt_dir, local_rank)
            return None
        found = resume.find_newest(run_dir, self.ckpt_dir, rank=self.rank,
                                   local_rank=local_rank, record=self._run_record())
        if found is None:
            return None
        self._restore(found)
        dd.rank_zero_print(f"resumed from {found.path} (epoch {self.epoch + 1}, step "
                           f"{self.step})")
        return str(found.path)

    def _monitor_as_saved(self, saved: dict[str, Any]) -> None:
        """A run whose monitor was left to its default goes on with the metric it began with:
        its best value is in that metric's units. A checkpoint that names none was written
        before the monitor was saved, when a multi-series split defaulted to `val_rmse`."""
        if self.config.monitor:
            return
        split = self.split
        before = default_monitor(split.task, split.validation is not None,
                                 split.vocabulary is not None)
        monitor = saved.get("monitor", before)
        if monitor != self.monitor:
            dd.rank_zero_print(f"monitor: {monitor}, as the run began (today's default for "
                               f"this data is {self.monitor})")
            self.monitor = self.early.monitor = monitor

    def _restore(self, found: resume.Found) -> None:
        state, trainer = found.state, found.state["trainer"]
        self.learner.load_checkpoint(state["learner"], found.path)
        self._monitor_as_saved(state["early_stopping"])
        self.early.load_state_dict(state["early_stopping"])
        self.history = list(state["history"])
        self.step = trainer["step"]
        self.step_history = list(trainer.get("step_history", []))
        self.best_step = trainer.get("best_step")
        self._point_sums = resume.partial_sums(trainer.get("point_sums"), self.rank,
                                               self.world_size)
        if trainer["epoch_done"]:
            self.epoch = trainer["epoch"] + 1
        else:
            self.epoch = trainer["epoch"]
            # On another world size the sampler continues after the same global sample
            # position: steps done x global batch.
            self.sampler.load_state_dict(state["sampler"])
            self._epoch_sums = resume.partial_sums(trainer.get("partial_sums"), self.rank,
                                                   self.world_size)
        saved_world = found.meta["world_size"]
        if saved_world == self.world_size:
            rng.restore(state["rng"][self.rank])
        else:
            log.warning("resuming a %d-rank checkpoint on %d rank(s): same parameters and "
                        "samples per step, but each rank's RNG stream (dropout) is drawn afresh",
                        saved_world, self.world_size)
            rng.seed_everything(self.config.seed + 1000 * self.epoch + self.rank)

    def _throughput_setup(self) -> dict[str, Any]:
        """Collective: the model's training FLOPs per token and one device's peak (rank 0's,
        the same in every rank's summary), for the MFU; {} for a model that declares no FLOPs
        per token, or data that are not tokens."""
        declared = self.learner.flops_per_token()
        if declared is None or self.tokens_per_sample is None:
            return {}
        per_token, dtype = declared
        peak = dd.broadcast_object(flops.peak_flops(self.runtime.device, dtype,
                                                    self.config.peak_flops))
        out: dict[str, Any] = {"flops_per_token": per_token, "peak_flops": peak.rate,
                               "peak_flops_source": peak.source}
        if peak.rate:
            out["mfu_per_token"] = per_token / (peak.rate * self.world_size)
        return out

    def _rates(self, samples: int) -> dict[str, Any]:
        """Token data: the tokens seen, tokens per second of training (evaluations left out)
        and the MFU."""
        if self.tokens_per_sample is None:
            return {}
        tokens_per_s = samples * self.tokens_per_sample / self.train_s if self.train_s else 0.0
        out: dict[str, Any] = {"tokens_per_s": tokens_per_s}
        out.update({k: v for k, v in self.throughput.items() if k != "mfu_per_token"})
        if "mfu_per_token" in self.throughput:
            out["mfu"] = self.throughput["mfu_per_token"] * tokens_per_s
        return out

    def _token_report(self) -> dict[str, Any]:
        """Token data: the vocabulary's kind and size and the characters outside it met in
        each part (mapped to its unknown id)."""
        vocabulary = self.split.vocabulary
        if vocabulary is None:
            return {}
        return {"vocabulary": {"kind": vocabulary.kind, "size": vocabulary.size,
                               "file": VOCABULARY_FILE},
                "unknown_tokens": dict(self.split.unknown_tokens)}

    def _step_report(self) -> dict[str, Any]:
        """Where the run is in steps: epochs as their view, samples (and tokens) seen, the
        step of the best validation point."""
        seen = self._samples_seen()
        out: dict[str, Any] = {"epochs_done": self.step / self.steps_per_epoch,
                               "samples_seen": seen, "best_step": self.best_step}
        if self.tokens_per_sample is not None:
            out["tokens_seen"] = seen * self.tokens_per_sample
        return out

    # ------------------------------------------------------------------------------ the end
    def _summary(self, wall_s: float, samples: int, resumed_from: str | None) -> dict[str, Any]:
        final = self.history[-1] if self.history else {}
        best = self.early.best_epoch
        chosen = {"monitor": self.monitor, f"best_{self.monitor}": self.early.best} \
            if self.monitor else {"monitor": None}
        ended_early = self.early.should_stop and (
            self.step < self.config.max_steps if self.config.max_steps is not None
            else self.epoch < self.config.num_epochs)
        return {
            **{k: v for k, v in final.items() if k.startswith("test_")},
            **{k: v for k, v in final.items() if k.startswith("val_")},
            "final_epoch": final.get("epoch"), "steps": self.step, **self._step_report(),
            "best_epoch": best, **chosen,
            "stopped_early": ended_early,
            "world_size": self.world_size, "batch_size": self.config.global_batch_size,
            "wall_time_s": wall_s,
            "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
            **self._rates(samples), **self._token_report(),
            "data_wait_s": self.data_wait_s, "train_time_s": self.train_s,
            "data_wait_share": self.data_wait_s / self.train_s if self.train_s > 0 else 0.0,
            **self._skipped_samples(),
            "checkpoint_pause_s": _pause_stats(self.checkpoint_pauses),
            "slow_ranks": self.step_times.slow_ranks,
            "params_sha256": params_sha256(self.learner.model_state_dict()),
            "resumed_from": resumed_from, "run_dir": str(self.config.out_dir),
            "config": self.config.to_json(),
            **self._after_training("report", lambda: self.learner.report(
                Path(self.config.out_dir) if self.rank == 0 else None, self.split)),
        }

    def _after_training(self, what: str, part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What `part` adds to the summary, or, when it fails, `failed_after_training` naming
        it: nothing after the last step may lose a run whose checkpoints are written (the
        job ends non-zero on it once summary.json is out: dptrain.train.job)."""
        try:
            faults.fail_after_training(what)
            return part()
        except Exception as err:  # noqa: BLE001 - anything: the run is whole, say what failed
            return {"failed_after_training": f"{what}: {type(err).__name__}: {err}"}

    def _skipped_samples(self) -> dict[str, Any]:
        """Samples the loaders left out (`--bad-images skip`), over every rank: collective."""
        skipped = set(self.loader.skipped).union(
            *(loader.skipped for _, loader in self.eval_parts.values()))
        seen = dd.all_gather_object(sorted(skipped))
        reasons = sorted(set().union(*seen))
        if not reasons:
            return {}
        if self.rank == 0:
            log.warning("left out %d unreadable sample(s), e.g. %s", len(reasons), reasons[0])
        return {"skipped_samples": len(reasons), "skipped_examples": reasons[:10]}

    def _finish(self, summary: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        out = Path(self.config.out_dir)
        if self.tb is not None:
            self.tb.close()
        failed = self._after_training("plots", lambda: (loggers.plot_learning_curves(
            out / "learning_curves.png", self.history), {})[1])
        if failed and "failed_after_training" not in summary:
            summary.update(failed)
        tmp = out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(out / "summary.json")
