"""Trainer: epochs or steps over sharded data, exact evaluation, atomic checkpoints with exact
resume.

The Trainer drives any `Learner` (dptrain.learners.protocol) and knows nothing about TAGI or
autograd, nor about a model family: what a family adds to its report (figures per predicted
position, summary entries, its default monitor) comes in a `MetricExtras`
(dptrain.train.extras) from the caller. Every rank runs `fit()`; collectives happen inside the
learner's `train_step`, in the metric reduction at each epoch end and validation point, and
around checkpoints.

Steps are the run's clock (docs/howto/checkpoints.md, Steps and validation points): a run ends
after `epochs` epochs or at global step `max_steps` (mid-epoch if so: epochs are then a view
of steps), and validates at each epoch end or, with `val_every`, every that many steps and at
its end. Each validation point is a row of steps.csv (when the run counts steps) and a chance
for best/ and early stopping; with `val_every` each also writes a checkpoint, so that best/ can
hold it and a resumed run never validates a point twice.

This module is the loop; beside it: its config (`dptrain.train.config.TrainConfig`), what a
checkpoint holds (`dptrain.train.state.TrainState`), its report (`dptrain.train.reporting`:
progress lines, the csv rows, summary.json) and its metric names
(`dptrain.train.metric_names`: the derived columns and the default monitor).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
from dptrain.data.loader import BatchLoader, fetch_batch
from dptrain.errors import ConfigError, RankFailure
from dptrain.fingerprint import params_sha256
from dptrain.learners.protocol import Batch, Learner, Metrics
from dptrain.runtime.collectives import as_rank_failure
from dptrain.train import checkpoint as ckpt
from dptrain.train import resume, rng, steps
from dptrain.train.config import TrainConfig
from dptrain.train.early_stopping import EarlyStopping
from dptrain.train.extras import NONE, MetricExtras
from dptrain.train.metric_names import default_monitor, derived, metric_names, split_monitor
from dptrain.train.reporting import Reporter, Totals, after_training, epoch_row
from dptrain.train.state import TrainState
from dptrain.train.stragglers import StepTimes
from dptrain.train.writer import BackgroundWriter, snapshot

__all__ = ["MetricExtras", "TrainConfig", "Trainer", "default_monitor", "metric_names",
           "params_sha256", "split_monitor"]
"""The Trainer and what its callers import with it, here where they all once lived."""

log = logging.getLogger(__name__)


def _add(sums: Metrics, metrics: Metrics) -> None:
    """Add a step's (sum, count) per metric to `sums`, in place."""
    for name, (s, c) in metrics.items():
        total_s, total_c = sums.get(name, (0.0, 0.0))
        sums[name] = (total_s + s, total_c + c)


class Trainer:
    """Fit a learner on a split, data-parallel over the ranks of `runtime`; `extras`: what the
    model family adds to the report (`MetricExtras`; default: nothing)."""

    def __init__(self, learner: Learner, split: Split, config: TrainConfig,
                 runtime: dd.Runtime, extras: MetricExtras = NONE) -> None:
        self.learner, self.split, self.config, self.runtime = learner, split, config, runtime
        self.extras = extras
        self.rank, self.world_size = runtime.env.rank, runtime.env.world_size
        if config.batch_size % self.world_size:
            works = ", ".join(map(str, world_sizes_dividing(config.batch_size)))
            raise ConfigError(f"batch_size {config.batch_size} must be divisible "
                              f"by the world size {self.world_size}: every rank takes an equal "
                              f"share; world sizes that work: {works}")
        self.local_batch_size = config.batch_size // self.world_size
        self._build_data()
        self.report = Reporter(config, extras, rank=self.rank, world_size=self.world_size,
                               steps_per_epoch=self.steps_per_epoch)
        """Progress lines, TensorBoard, the csv files and summary.json."""
        self.data_wait_s = 0.0
        """Seconds the training steps waited for their batches (not the evaluations)."""
        self.step_times = StepTimes(self.rank, self.world_size, self._metric_device())
        """Per-rank compute, wait and data time of the steps (ranks.csv; slow ranks named)."""
        self.train_s = 0.0
        """Seconds spent training (waits for batches included; evaluations and checkpoints not)."""
        self.paused_s = 0.0
        """Seconds of the current epoch spent in validation points and mid-epoch checkpoints."""
        self.monitor = config.monitor or split_monitor(split, extras)
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
        self._layout = ""
        self._init_progress()

    def _build_data(self) -> None:
        """The train sampler and loader, and each evaluated part's."""
        split, config = self.split, self.config
        # The learner says whether it takes unequal shards; padding them equal would make the
        # epoch's last step depend on the world size (docs/design.md, The Learner protocol).
        self.sampler = ShardedSampler(split.train, rank=self.rank, world_size=self.world_size,
                                      seed=config.seed, mode="train",
                                      uneven_last_batch=self.learner.uneven_last_batch)
        pin = self.runtime.device.type == "cuda"
        self.loader = BatchLoader(split.train, self.sampler, self.local_batch_size,
                                  workers=config.workers, pin_memory=pin, mixing=config.mixing)
        self.steps_per_epoch = steps_per_epoch(len(split.train), self.world_size,
                                               self.local_batch_size)
        """Global steps of one epoch: ceil(training samples / global batch), any world size."""
        # Each evaluated part, validation first: the test part's evaluation is the learner's
        # last of the epoch (its calibration bins are the test part's in the summary).
        # A split without a test part of its own (a text's) names its validation part as the
        # test part; it is evaluated once, as validation, and no test_* figure is made up.
        test = split.test if split.test is not split.validation else None
        self.eval_parts = {prefix: self._eval_part(dataset) for prefix, dataset in
                           (("val", self._validation_part()), ("test", test))
                           if dataset is not None}

    def _init_progress(self) -> None:
        """Where the run stands: nothing done yet (`_restore` sets it from a checkpoint)."""
        self.history: list[dict[str, Any]] = []
        """epochs.csv's rows."""
        self.epoch, self.step = 0, 0
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

    @property
    def counts_steps(self) -> bool:
        """Whether the run is counted in steps (max_steps or val_every): it writes steps.csv."""
        return self.config.max_steps is not None or self.config.val_every is not None

    def _validation_part(self) -> Any:
        """The validation part, or its `val_batches` global batches (the same samples at every
        validation point, on every rank and world size)."""
        dataset = self.split.validation
        if dataset is None or self.config.val_batches is None:
            return dataset
        chosen = steps.validation_indices(len(dataset), batches=self.config.val_batches,
                                          batch_size=self.config.batch_size,
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
        self.report.open()
        self.report.measure(self.learner, self.runtime.device)
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
                                       and self.epoch + 1 >= self.config.epochs)
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
        self.report.finish(summary, self.history)
        return summary

    def _stopped(self) -> bool:
        """The run ends at this step: max_steps reached, or early stopping said so."""
        return self.early.should_stop or (self.config.max_steps is not None
                                          and self.step >= self.config.max_steps)

    def _run_over(self) -> bool:
        """Nothing is left to train (a run resumed from its last checkpoint included)."""
        return self._stopped() or (self.config.max_steps is None
                                   and self.epoch >= self.config.epochs)

    def _train_epoch(self) -> int:
        """Steps to the epoch's end, to max_steps, or to an early stop at a validation point;
        the samples this run trained on, over every rank."""
        seen = 0
        total = self.sampler.num_batches(self.local_batch_size)
        done = self.sampler.position // self.local_batch_size
        if self.config.max_steps is not None:
            total = min(total, done + self.config.max_steps - self.step)
        progress = self.report.progress(total=total, done=done, epoch=self.epoch,
                                        step=self.step)
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
            self.report.log_step(self._step_scalars, self.step)
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
                                  global_batch_size=self.config.batch_size,
                                  num_samples=len(self.split.train))

    def _epoch_means(self, *, clear: bool) -> dict[str, float]:
        """Collective: the train metrics of the epoch's steps so far, over every rank; the sums
        are kept for a mid-epoch checkpoint unless the epoch is over (`clear`)."""
        sums = self._epoch_sums
        if clear:
            self._epoch_sums = {}
        means = dd.means(dd.reduce_sum_count(sums, self._metric_device()))
        return derived(self.learner.end_training(means), "train", self.extras)

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
        since = {k: v for k, v in derived(means, "train", self.extras).items()
                 if not k.startswith("train__")}
        row = self.report.point_row(step=self.step, samples_seen=self._samples_seen(),
                                    scalars=self._step_scalars, since=since,
                                    evaluated=evaluated)
        self.step_history.append(row)
        improved = False
        if self.config.val_every:
            improved = self.early.update(self.epoch + 1, row)
        if improved:
            self.best_step = self.step
        self.report.write_point(self.step_history)
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
        return derived(self.learner.end_evaluation(means, part), part, self.extras)

    def _end_epoch(self, train_means: dict[str, float],
                   evaluated: dict[str, dict[str, float]], last: bool) -> bool:
        """The epoch's row of epochs.csv (an epoch the run ends in counts as one, and a later
        run that goes on replaces its row); without `val_every` its validation is a point that
        chooses. True when the checkpoint written next becomes best/."""
        record = epoch_row(epoch=self.epoch + 1, step=self.step, scalars=self._step_scalars,
                           train_means=train_means, evaluated=evaluated)
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
        self.report.write_epoch(self.history, record)
        return improved

    def _log_step_times(self) -> None:
        """Collective: every rank's mean step times of the epoch to ranks.csv and TensorBoard
        (not epochs.csv, which must not change from run to run: dptrain.train.stragglers)."""
        rows = self.step_times.epoch_rows(self.epoch + 1)
        self.report.write_rank_times(rows, epoch=self.epoch + 1, step=self.step)

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
        self.report.flush()  # the steps before this checkpoint, which a resume will not log
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
            saved = self._state(learner_state, epoch_done=epoch_done, rng_states=rng_states,
                                partial_sums=partial_sums, point_sums=point_sums)
            state = snapshot(saved.to_dict())
            meta = saved.meta(world_size=self.world_size, config=self.config.to_json(),
                              run_record=record)
            self._writer.submit(lambda: self._publish(tmp, state, meta, is_best, midway))
        else:
            # This rank's own files (its shards), finished in its writer's thread, so that the
            # next checkpoint and the run's end wait for them as rank 0's wait for its write.
            self._writer.submit(self.learner.checkpoint_written)
        if not self.config.async_checkpoints:
            dd.barrier()  # nobody runs ahead (or is killed) before the checkpoint is published
        self.checkpoint_pauses.append(time.perf_counter() - started)

    def _state(self, learner_state: Any, *, epoch_done: bool, rng_states: list[Any],
               partial_sums: list[dict[str, Any]], point_sums: list[dict[str, Any]] | None
               ) -> TrainState:
        """The checkpoint's state (rank 0): the learner's, the sampler's, every rank's RNG
        and sums. A run counted in steps adds the validation points so far, the best one's
        step and every rank's train sums since the last point (`point_sums`); a run in epochs
        adds nothing, so its checkpoints stay as they were."""
        counted = point_sums is not None
        return TrainState(learner=learner_state, epoch=self.epoch, step=self.step,
                          epoch_done=epoch_done, sampler=self.sampler.state_dict(),
                          rng=rng_states, early_stopping=self.early.state_dict(),
                          history=self.history, partial_sums=partial_sums,
                          step_history=self.step_history if counted else None,
                          best_step=self.best_step if counted else None,
                          point_sums=point_sums)

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
        return resume.as_json({"batch_size": self.config.batch_size,
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
        before = default_monitor(split.task, split.validation is not None, self.extras.monitor)
        monitor = saved.get("monitor", before)
        if monitor != self.monitor:
            dd.rank_zero_print(f"monitor: {monitor}, as the run began (today's default for "
                               f"this data is {self.monitor})")
            self.monitor = self.early.monitor = monitor

    def _restore(self, found: resume.Found) -> None:
        """Where the run stands, from the checkpoint `found` (`TrainState`)."""
        state = TrainState.from_dict(found.state)
        self.learner.load_checkpoint(state.learner, found.path)
        self._monitor_as_saved(state.early_stopping)
        self.early.load_state_dict(state.early_stopping)
        self.history = list(state.history)
        self.step = state.step
        self.step_history = list(state.step_history or [])
        self.best_step = state.best_step
        self._point_sums = resume.partial_sums(state.point_sums, self.rank, self.world_size)
        if state.epoch_done:
            self.epoch = state.epoch + 1
        else:
            self.epoch = state.epoch
            # On another world size the sampler continues after the same global sample
            # position: steps done x global batch.
            self.sampler.load_state_dict(state.sampler)
            self._epoch_sums = resume.partial_sums(state.partial_sums, self.rank,
                                                   self.world_size)
        saved_world = found.meta["world_size"]
        if saved_world == self.world_size:
            rng.restore(state.rng[self.rank])
        else:
            log.warning("resuming a %d-rank checkpoint on %d rank(s): same parameters and "
                        "samples per step, but each rank's RNG stream (dropout) is drawn afresh",
                        saved_world, self.world_size)
            rng.seed_everything(self.config.seed + 1000 * self.epoch + self.rank)

    # ------------------------------------------------------------------------------ the end
    def _summary(self, wall_s: float, samples: int, resumed_from: str | None) -> dict[str, Any]:
        """Collective: summary.json (`Reporter.summary`), once the last checkpoint is out. The
        samples left out, the parameters' hash and the learner's report are gathered in this
        order on every rank."""
        skipped = self._skipped_samples()
        sha = params_sha256(self.learner.model_state_dict())
        learner_report = after_training("report", lambda: self.learner.report(
            Path(self.config.out_dir) if self.rank == 0 else None, self.split))
        totals = Totals(wall_s=wall_s, samples=samples, train_s=self.train_s,
                        data_wait_s=self.data_wait_s, checkpoint_pauses=self.checkpoint_pauses,
                        slow_ranks=self.step_times.slow_ranks)
        return self.report.summary(
            history=self.history, early=self.early, monitor=self.monitor, step=self.step,
            epoch=self.epoch, samples_seen=self._samples_seen(), best_step=self.best_step,
            totals=totals, skipped=skipped, params_sha256=sha, resumed_from=resumed_from,
            learner_report=learner_report)

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
