"""Trainer: epochs over sharded data, exact evaluation, atomic checkpoints with exact resume.

The Trainer drives any `Learner` (dptrain.learners.protocol) and knows nothing about TAGI or
autograd. Every rank runs `fit()`; collectives happen inside the learner's `train_step`, in the
metric reduction at each epoch end, and around checkpoints.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dptrain import runtime as dd
from dptrain.data import ShardedSampler, Split, num_samples_per_rank, world_sizes_dividing
from dptrain.data.loader import BatchLoader, fetch_batch
from dptrain.data.mixing import Mixing
from dptrain.errors import ConfigError, RankFailure
from dptrain.fingerprint import params_sha256
from dptrain.learners.protocol import Batch, Learner, Metrics
from dptrain.train import checkpoint as ckpt
from dptrain.train import loggers, resume, rng
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
    validation metric (val_error, val_rmse) when the split has a validation part, else
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
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"resume must be 'auto' or 'never', got {self.resume!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["fail_at"] = None if self.fail_at is None else str(self.fail_at)
        return out


def _derived(means: dict[str, float], prefix: str) -> dict[str, float]:
    """`{prefix}_{name}` per metric, plus rmse from mse (and ema_rmse from ema_mse)."""
    out = {f"{prefix}_{k}": v for k, v in means.items()}
    for name in ("mse", "ema_mse"):
        if name in means:
            out[f"{prefix}_{name[:-3]}rmse"] = math.sqrt(means[name])
    return out


def metric_names(reported: Iterable[str], prefix: str) -> list[str]:
    """The columns of epochs.csv that metrics reported as `reported` become (`train`, `val`
    or `test` prefix, rmse from mse)."""
    return list(_derived(dict.fromkeys(reported, 0.0), prefix))


def default_monitor(task: str, has_validation: bool) -> str:
    """The metric that chooses when none is named: the validation error (classification) or
    RMSE (regression); "" (nothing chosen) without a validation part."""
    if not has_validation:
        return ""
    return "val_error" if task == "classification" else "val_rmse"


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
        # Each evaluated part, validation first: the test part's evaluation is the learner's
        # last of the epoch (its calibration bins are the test part's in the summary).
        self.eval_parts = {prefix: self._eval_part(dataset) for prefix, dataset in
                           (("val", split.validation), ("test", split.test))
                           if dataset is not None}
        self.data_wait_s = 0.0
        """Seconds the training steps waited for their batches (not the evaluations)."""
        self.step_times = StepTimes(self.rank, self.world_size, self._metric_device())
        """Per-rank compute, wait and data time of the steps (ranks.csv; slow ranks named)."""
        self.train_s = 0.0
        """Seconds spent in training epochs (waits for batches included, evaluations not)."""
        self.monitor = config.monitor or default_monitor(split.task,
                                                         split.validation is not None)
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

    @property
    def eval_sampler(self) -> ShardedSampler:
        """The test part's sampler (this rank's share of the test samples)."""
        return self.eval_parts["test"][0]

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to the last epoch (or early stop) and return the summary (also summary.json).
        The data loaders' worker processes and the checkpoint writer's thread end with it,
        however it ends."""
        try:
            return self._fit()
        except BaseException as failure:
            if isinstance(failure, RankFailure) and failure.step is None:
                failure.step = self.step  # the launcher's one line names it
            # The write in flight is of a good state (a peer failing later does not change
            # it): let it land, so a restart loses less; its own error would hide this one.
            try:
                self._writer.wait()
            except BaseException as err:  # noqa: BLE001
                log.warning("the checkpoint being written when the run failed was lost: %s",
                            err)
            raise
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
        samples_seen = 0
        while self.epoch < self.config.num_epochs and not self.early.should_stop:
            self.sampler.set_epoch(self.epoch)
            # per-epoch schedules (TAGI σ_v), and augmentation draws through the loader, are
            # functions of the epoch, so a resumed run continues them exactly
            self.learner.set_epoch(self.epoch)
            epoch_start = time.perf_counter()
            train_means, seen = self._train_epoch()
            self.train_s += time.perf_counter() - epoch_start
            samples_seen += seen
            evaluated = {name: self._evaluate(name) for name in self.eval_parts}
            improved = self._end_epoch(train_means, evaluated)
            self._log_step_times()
            self._save_checkpoint(epoch_done=True, is_best=improved)
            self.epoch += 1
        # The last checkpoint is published before the run says it is done, on every rank (a
        # caller may look for it as soon as fit() returns, on any rank).
        self._writer.wait()
        dd.barrier()
        summary = self._summary(time.perf_counter() - start, samples_seen, resumed_from)
        self._finish(summary)
        return summary

    def _train_epoch(self) -> tuple[dict[str, float], int]:
        sums = self._epoch_sums  # empty, or restored from a mid-epoch checkpoint
        seen = 0
        progress = Progress(total=self.sampler.num_batches(self.local_batch_size),
                            done=self.sampler.position // self.local_batch_size,
                            desc=f"epoch {self.epoch + 1}/{self.config.num_epochs}",
                            enabled=self.config.progress and self.rank == 0)
        batches = iter(self.loader)
        while True:
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
            for name, (s, c) in metrics.items():
                total = sums.get(name, (0.0, 0.0))
                sums[name] = (total[0] + s, total[1] + c)
            progress.update(len(batch[1]) * self.world_size, metrics)
            if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0 \
                    and self.sampler.num_remaining > 0:
                self._save_checkpoint(epoch_done=False)
        progress.close()
        self._epoch_sums = {}
        # The ranks' own counts: an uneven last step holds fewer than world size x rank 0's.
        seen = sum(dd.all_gather_object(seen))
        means = dd.means(dd.reduce_sum_count(sums, self._metric_device()))
        return _derived(self.learner.end_training(means), "train"), seen

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
        return _derived(self.learner.end_evaluation(means, part), part)

    def _end_epoch(self, train_means: dict[str, float],
                   evaluated: dict[str, dict[str, float]]) -> bool:
        record = {"epoch": self.epoch + 1, "step": self.step, **self._step_scalars,
                  **train_means, **{k: v for means in evaluated.values() for k, v in means.items()}}
        self.history.append(record)
        improved = self.early.update(self.epoch + 1, record)
        if self.rank == 0:
            loggers.write_csv(Path(self.config.out_dir) / "epochs.csv", self.history)
            if self.tb is not None:
                self.tb.log(record)
            shown = "  ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "epoch")
            dd.rank_zero_print(f"epoch {self.epoch + 1}/{self.config.num_epochs}  {shown}")
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
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    # -------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, *, epoch_done: bool, is_best: bool = False) -> None:
        """Collective: every rank contributes its RNG state and its learner part; rank 0 copies
        the state to memory and writes it in the background (`TrainConfig.async_checkpoints`),
        publishing it atomically. A sharded learner writes its shards here, on every rank,
        before anyone steps on (torch.distributed.checkpoint); rank 0 then checksums and
        publishes them in the background too, as nothing touches those files any more."""
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
        if self.rank == 0:
            # One write in flight at most; it must be done before `begin`, as its pruning
            # removes stale temporary folders.
            self._writer.wait()
        tmp = ckpt.begin(self.ckpt_dir, self.step) if self.rank == 0 else None
        tmp = Path(dd.broadcast_object(str(tmp)))
        learner_state = self.learner.save_checkpoint(tmp)
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
                                          "partial_sums": partial_sums}})
            meta = {"step": self.step, "epoch": self.epoch, "epoch_done": epoch_done,
                    "world_size": self.world_size, "config": self.config.to_json(),
                    "run_record": record, "sharded": record.get("sharded_checkpoint", False),
                    "saved_at": time.time()}
            self._writer.submit(lambda: self._publish(tmp, state, meta, is_best, midway))
        if not self.config.async_checkpoints:
            dd.barrier()  # nobody runs ahead (or is killed) before the checkpoint is published
        self.checkpoint_pauses.append(time.perf_counter() - started)

    def _publish(self, tmp: Path, state: dict[str, Any], meta: dict[str, Any], is_best: bool,
                 midway: Any) -> None:
        """Rank 0, in the writer's thread: write, fsync, publish, copy as best, prune."""
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

    def _restore(self, found: resume.Found) -> None:
        state, trainer = found.state, found.state["trainer"]
        self.learner.load_checkpoint(state["learner"], found.path)
        self.early.load_state_dict(state["early_stopping"])
        self.history = list(state["history"])
        self.step = trainer["step"]
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

    # ------------------------------------------------------------------------------ the end
    def _summary(self, wall_s: float, samples: int, resumed_from: str | None) -> dict[str, Any]:
        final = self.history[-1] if self.history else {}
        best = self.early.best_epoch
        chosen = {"monitor": self.monitor, f"best_{self.monitor}": self.early.best} \
            if self.monitor else {"monitor": None}
        return {
            **{k: v for k, v in final.items() if k.startswith("test_")},
            **{k: v for k, v in final.items() if k.startswith("val_")},
            "final_epoch": final.get("epoch"), "steps": self.step,
            "best_epoch": best, **chosen,
            "stopped_early": self.early.should_stop and self.epoch < self.config.num_epochs,
            "world_size": self.world_size, "batch_size": self.config.global_batch_size,
            "wall_time_s": wall_s,
            "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
            "data_wait_s": self.data_wait_s, "train_time_s": self.train_s,
            "data_wait_share": self.data_wait_s / self.train_s if self.train_s > 0 else 0.0,
            **self._skipped_samples(),
            "checkpoint_pause_s": _pause_stats(self.checkpoint_pauses),
            "slow_ranks": self.step_times.slow_ranks,
            "params_sha256": params_sha256(self.learner.model_state_dict()),
            "resumed_from": resumed_from, "run_dir": str(self.config.out_dir),
            "config": self.config.to_json(),
            **self.learner.report(Path(self.config.out_dir) if self.rank == 0 else None,
                                  self.split),
        }

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
        loggers.plot_learning_curves(out / "learning_curves.png", self.history)
        tmp = out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(out / "summary.json")
