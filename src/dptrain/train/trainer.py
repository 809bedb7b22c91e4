"""Trainer: epochs over sharded data, exact evaluation, atomic checkpoints with exact resume.

The Trainer drives any `Learner` (dptrain.learners.protocol) and knows nothing about TAGI or
autograd. Every rank runs `fit()`; collectives happen inside the learner's `train_step`, in the
metric reduction at each epoch end, and around checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dptrain import dist as dd
from dptrain.data import ArrayDataset, ShardedSampler, Split, num_samples_per_rank
from dptrain.errors import CheckpointError, ConfigError
from dptrain.learners.calibration import expected_calibration_error, pop_calibration
from dptrain.learners.protocol import Learner, Metrics
from dptrain.train import checkpoint as ckpt
from dptrain.train import loggers, resume, rng
from dptrain.train.early_stopping import EarlyStopping
from dptrain.train.faults import FailAt
from dptrain.train.progress import Progress

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train; every field is stored in each checkpoint and in summary.json."""

    out_dir: Path
    """Run directory: checkpoints/, epochs.csv, tb/, plots, summary.json."""
    num_epochs: int = 10
    batch_size: int = 32
    """Global batch of one step; each rank takes batch_size / world_size of it. Because rank r
    takes every world_size-th index of one shared permutation, the global batch of step k is
    the same samples at any world size (up to the train sampler's wrap-around padding)."""
    seed: int = 0
    """Seeds the data order and every RNG (rank r draws from seed + r)."""
    checkpoint_every: int | None = None
    """Also checkpoint every this many steps (one is always written at each epoch end)."""
    keep_last: int = 3
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest valid checkpoint in out_dir, if any."""
    monitor: str = "test_error"
    monitor_mode: Literal["min", "max"] = "min"
    patience: int | None = None
    """Stop after this many epochs without a better monitored value (None: never)."""
    eval_batch_size: int = 512
    progress: bool = True
    fail_at: FailAt | None = None
    record: dict[str, Any] = field(default_factory=dict)
    """What built this run (the CLI's options), stored for the record."""
    run_record: dict[str, Any] = field(default_factory=dict)
    """The options that define this run (JSON values: model and its sizes, data, learner
    options...). Each checkpoint stores them with the Trainer's own (batch size, seed, the
    model's parameter names and shapes); resuming from a checkpoint whose record differs is
    refused, naming each difference, before anything is loaded: one run per directory. Leave
    out what may change on resume (epochs, patience, ...)."""

    def __post_init__(self) -> None:
        for name in ("num_epochs", "batch_size", "keep_last", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1 step, got {self.checkpoint_every}")
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"resume must be 'auto' or 'never', got {self.resume!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["fail_at"] = None if self.fail_at is None else str(self.fail_at)
        return out


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """Fingerprint of named tensors (names, dtypes, shapes and bytes), for exact comparisons."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _derived(means: dict[str, float], prefix: str) -> dict[str, float]:
    """`{prefix}_{name}` per metric, plus rmse from mse."""
    out = {f"{prefix}_{k}": v for k, v in means.items()}
    if "mse" in means:
        out[f"{prefix}_rmse"] = math.sqrt(means["mse"])
    return out


class Trainer:
    """Fit a learner on a split, data-parallel over the ranks of `runtime`."""

    def __init__(self, learner: Learner, split: Split, config: TrainConfig,
                 runtime: dd.Runtime) -> None:
        self.learner, self.split, self.config, self.runtime = learner, split, config, runtime
        self.rank, self.world_size = runtime.env.rank, runtime.env.world_size
        if config.batch_size % self.world_size:
            raise ConfigError(f"batch_size {config.batch_size} must be divisible by the world "
                              f"size {self.world_size}: every rank takes an equal share")
        self.local_batch = config.batch_size // self.world_size
        self.sampler = ShardedSampler(split.train, rank=self.rank, world_size=self.world_size,
                                      seed=config.seed, mode="train")
        self.eval_sampler = ShardedSampler(split.test, rank=self.rank,
                                           world_size=self.world_size, mode="eval")
        self.early = EarlyStopping(config.monitor, mode=config.monitor_mode,
                                   patience=config.patience)
        self.ckpt_dir = Path(config.out_dir) / "checkpoints"
        self.history: list[dict[str, Any]] = []
        self.epoch, self.step = 0, 0
        self.tb: loggers.TensorBoardLogger | None = None
        self._layout = ""
        self._epoch_sums: Metrics = {}
        """This rank's (sum, count) per train metric so far in the current epoch; saved in
        mid-epoch checkpoints so a resumed epoch reports the metrics of all its steps."""
        self.calibration: list[dict[str, float]] | None = None  # of the last evaluation

    # ----------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to the last epoch (or early stop) and return the summary (also summary.json)."""
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
            # per-epoch schedules (TAGI σ_v) and augmentation draws are functions of the epoch,
            # so a resumed run continues them exactly
            for owner in (self.learner, self.split.train):
                if hasattr(owner, "set_epoch"):
                    owner.set_epoch(self.epoch)
            train_means, seen = self._train_epoch()
            samples_seen += seen
            test_means = self._evaluate()
            improved = self._end_epoch(train_means, test_means)
            self._save_checkpoint(epoch_done=True, is_best=improved)
            self.epoch += 1
        summary = self._summary(time.perf_counter() - start, samples_seen, resumed_from)
        self._finish(summary)
        return summary

    def _train_epoch(self) -> tuple[dict[str, float], int]:
        sums = self._epoch_sums  # empty, or restored from a mid-epoch checkpoint
        seen = 0
        progress = Progress(total=self.sampler.num_batches(self.local_batch),
                            done=self.sampler.position // self.local_batch,
                            desc=f"epoch {self.epoch + 1}/{self.config.num_epochs}",
                            enabled=self.config.progress and self.rank == 0)
        for indices in self.sampler.batches(self.local_batch):
            if self.config.fail_at is not None:
                self.config.fail_at.maybe_kill(self.rank, self.step)
            metrics = self.learner.train_step(self._batch(self.split.train, indices))
            self.step += 1
            seen += len(indices) * self.world_size
            for name, (s, c) in metrics.items():
                total = sums.get(name, (0.0, 0.0))
                sums[name] = (total[0] + s, total[1] + c)
            progress.update(len(indices) * self.world_size, metrics)
            if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0 \
                    and self.sampler.num_remaining > 0:
                self._save_checkpoint(epoch_done=False)
        progress.close()
        self._epoch_sums = {}
        return _derived(dd.means(dd.reduce_sum_count(sums, self._metric_device())), "train"), seen

    def _evaluate(self) -> dict[str, float]:
        """Every test sample exactly once over the ranks (contract 5), reduced as sums."""
        sums: Metrics = {}
        self.eval_sampler.set_position(0)
        batches = list(self.eval_sampler.batches(self.config.eval_batch_size))
        if getattr(self.learner, "eval_is_collective", False):
            # A sharded model all-gathers its weights inside every eval step, so every rank
            # must take as many steps as rank 0 (which holds the most samples): pad with
            # empty batches, which count nothing.
            most = num_samples_per_rank(len(self.split.test), self.world_size, 0, mode="eval")
            empty = torch.zeros(0, dtype=torch.long)
            batches += [empty] * (math.ceil(most / self.config.eval_batch_size) - len(batches))
        for indices in batches:
            for name, (s, c) in self.learner.eval_step(self._batch(self.split.test,
                                                                   indices)).items():
                total = sums.get(name, (0.0, 0.0))
                sums[name] = (total[0] + s, total[1] + c)
        means = dd.means(dd.reduce_sum_count(sums, self._metric_device()))
        bins = pop_calibration(means)
        derived = _derived(means, "test")
        if bins is not None:
            derived["test_ece"] = expected_calibration_error(bins)
            self.calibration = bins
        return derived

    def _end_epoch(self, train_means: dict[str, float], test_means: dict[str, float]) -> bool:
        record = {"epoch": self.epoch + 1, "step": self.step, **train_means, **test_means}
        self.history.append(record)
        improved = self.early.update(self.epoch + 1, record)
        if self.rank == 0:
            loggers.write_csv(Path(self.config.out_dir) / "epochs.csv", self.history)
            if self.tb is not None:
                self.tb.log(record)
            shown = "  ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "epoch")
            dd.rank_zero_print(f"epoch {self.epoch + 1}/{self.config.num_epochs}  {shown}")
        return improved

    # ------------------------------------------------------------------------------ helpers
    def _metric_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo takes CPU ones.
        return self.runtime.device if self.runtime.backend == "nccl" else torch.device("cpu")

    def _batch(self, dataset: ArrayDataset, indices: torch.Tensor):
        x, y = dataset[indices]
        device = self.runtime.device
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    # -------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, *, epoch_done: bool, is_best: bool = False) -> None:
        """Collective: every rank contributes its RNG state; rank 0 writes atomically."""
        rng_states = dd.all_gather_object(rng.capture())
        fail_at = self.config.fail_at
        midway = None if fail_at is None else \
            (lambda: fail_at.maybe_kill_in_checkpoint(self.rank, self.step))
        if self.rank != 0 and midway is not None:
            midway()  # while rank 0 writes
        # Summed in the same order as an uninterrupted run, the epoch's metrics come out equal.
        partial_sums = dd.all_gather_object({} if epoch_done else dict(self._epoch_sums))
        sharded = getattr(self.learner, "is_sharded", False)
        tmp = ckpt.begin(self.ckpt_dir, self.step) if self.rank == 0 else None
        if sharded:
            tmp = Path(dd.broadcast_object(str(tmp)))
            dd.barrier()
            self.learner.save_sharded(tmp / "sharded")
            dd.barrier()
        if self.rank == 0:
            state = {"learner": {} if sharded else self.learner.state_dict(),
                     "sampler": self.sampler.state_dict(), "rng": rng_states,
                     "early_stopping": self.early.state_dict(), "history": self.history,
                     "trainer": {"epoch": self.epoch, "step": self.step,
                                 "epoch_done": epoch_done, "partial_sums": partial_sums}}
            meta = {"step": self.step, "epoch": self.epoch, "epoch_done": epoch_done,
                    "world_size": self.world_size, "config": self.config.to_json(),
                    "run_record": self._run_record(), "sharded": sharded,
                    "saved_at": time.time()}
            final = ckpt.commit(tmp, state, meta, midway=midway)
            if is_best:
                ckpt.copy_as_best(final, self.ckpt_dir)
            ckpt.prune(self.ckpt_dir, self.config.keep_last)
        dd.barrier()  # nobody runs ahead (or is killed) before the checkpoint is published

    def _run_record(self) -> dict[str, Any]:
        """What defines this run: the Trainer's own part and the caller's `run_record`."""
        return resume.as_json({"batch_size": self.config.batch_size, "seed": self.config.seed,
                               "sharded_checkpoint": getattr(self.learner, "is_sharded", False),
                               resume.LAYOUT_KEY: self._layout, **self.config.run_record})

    def _newest_listed(self) -> tuple[int, str] | None:
        """(step, path) of this node's newest step folder, valid or not (first local rank)."""
        if self.runtime.env.local_rank != 0:
            return None
        listed = ckpt.list_steps(self.ckpt_dir)
        return None if not listed else (int(listed[0].name.split("-")[1]), str(listed[0]))

    def _maybe_resume(self) -> str | None:
        """Load the newest valid checkpoint any node holds; collective.

        No shared filesystem is needed: the first rank of every node reports the newest valid
        checkpoint in its own run directory, the newest wins (a restarted job's rank 0 may sit
        on another node than the one that wrote it), and the rank that holds it reads it and
        broadcasts it. Sharded checkpoints are read by every rank from the same path, so they
        need a filesystem every node shares.
        """
        run_dir = Path(self.config.out_dir)
        if self.config.resume == "never":
            held = [h for h in dd.all_gather_object(self._newest_listed()) if h is not None]
            if held:
                raise resume.refuse_never(run_dir, Path(max(held)[1]))
            return None
        found = ckpt.latest_valid(self.ckpt_dir) if self.runtime.env.local_rank == 0 else None
        offers = dd.all_gather_object(None if found is None else found.step)
        ranked = [(step, -r) for r, step in enumerate(offers) if step is not None]
        if not ranked:
            return None
        holder = -max(ranked)[1]  # newest step; on a tie the lowest rank
        meta, path = dd.broadcast_object(
            (found.meta, str(found.path)) if self.rank == holder else None, src=holder)
        path = Path(path)
        # Every rank decides from the same meta, so every rank raises alike: nobody hangs.
        resume.check_same_run(run_dir, path, meta.get("run_record"), self._run_record())
        saved_world = meta["world_size"]
        if saved_world != self.world_size and not meta["epoch_done"]:
            raise CheckpointError(
                f"{path}: saved mid-epoch on {saved_world} rank(s), this run has "
                f"{self.world_size}: its sampler position means other samples here. Resume "
                f"with {saved_world} ranks, or from an epoch-end checkpoint")
        loaded: tuple[str, Any] | None = None
        if self.rank == holder:
            try:
                loaded = ("ok", found.load_state())
            except Exception as err:  # noqa: BLE001 - told to every rank, then raised there
                loaded = ("error", f"{path}/state.pt: cannot be loaded ({err})")
        status, state = dd.broadcast_object(loaded, src=holder)
        if status != "ok":
            raise CheckpointError(state)
        trainer = state["trainer"]
        if getattr(self.learner, "is_sharded", False):
            sees = dd.all_gather_object((path / "sharded").is_dir())
            blind = [r for r, ok in enumerate(sees) if not ok]
            if blind:
                raise CheckpointError(
                    f"{path / 'sharded'}: rank(s) {blind} cannot see this sharded checkpoint; "
                    f"sharded (FSDP) checkpoints need a run directory on a filesystem every "
                    f"node shares")
        if getattr(self.learner, "is_sharded", False):
            self.learner.load_sharded(path / "sharded")
        else:
            self.learner.load_state_dict(state["learner"])
        self.early.load_state_dict(state["early_stopping"])
        self.history = list(state["history"])
        self.step = trainer["step"]
        if trainer["epoch_done"]:
            self.epoch = trainer["epoch"] + 1
        else:
            self.epoch = trainer["epoch"]
            self.sampler.load_state_dict(state["sampler"])
            # Same world size here (checked above), so rank r continues rank r's sums.
            partial = trainer.get("partial_sums") or [{}] * self.world_size
            self._epoch_sums = {name: tuple(sc) for name, sc in partial[self.rank].items()}
        if saved_world == self.world_size:
            rng.restore(state["rng"][self.rank])
        else:
            log.warning("resuming %d-rank checkpoint on %d ranks: same parameters and epoch, "
                        "but data order and RNG streams differ from an uninterrupted run",
                        saved_world, self.world_size)
            rng.seed_everything(self.config.seed + 1000 * self.epoch + self.rank)
        dd.rank_zero_print(f"resumed from {path} (epoch {self.epoch + 1}, step {self.step})")
        return str(path)

    # ------------------------------------------------------------------------------ the end
    def _summary(self, wall_s: float, samples: int, resumed_from: str | None) -> dict[str, Any]:
        final = self.history[-1] if self.history else {}
        best = self.early.best_epoch
        return {
            **{k: v for k, v in final.items() if k.startswith("test_")},
            "final_epoch": final.get("epoch"), "steps": self.step,
            "best_epoch": best, f"best_{self.config.monitor}": self.early.best,
            "stopped_early": self.early.should_stop and self.epoch < self.config.num_epochs,
            "world_size": self.world_size, "batch_size": self.config.batch_size,
            "wall_time_s": wall_s,
            "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
            "params_sha256": params_sha256(self.learner.model_state_dict()),
            "resumed_from": resumed_from, "run_dir": str(self.config.out_dir),
            "config": self.config.to_json(),
            **({"calibration_bins": self.calibration} if self.calibration else {}),
        }

    def _finish(self, summary: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        out = Path(self.config.out_dir)
        if self.tb is not None:
            self.tb.close()
        loggers.plot_learning_curves(out / "learning_curves.png", self.history)
        predict = getattr(self.learner, "predict_bands", None)
        if self.split.task == "regression" and self.split.input_shape == (1,) and predict:
            self._plot_predictions(out / "predictions.png", predict)
        if self.calibration is not None:
            loggers.plot_reliability(out / "reliability.png", self.calibration)
        tmp = out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(out / "summary.json")

    def _plot_predictions(self, path: Path, predict_bands) -> None:
        """Predictive mean with its epistemic and total ±2σ bands over the test inputs, in the
        data's own units."""
        split = self.split
        mean, epistemic_std, total_std = (
            t.cpu() for t in predict_bands(split.test.x.to(self.runtime.device)))
        x_of = split.x_norm.invert if split.x_norm is not None else (lambda t: t)
        y_of = split.y_norm.invert if split.y_norm is not None else (lambda t: t)
        y_std = split.y_norm.std if split.y_norm is not None else 1.0
        loggers.plot_regression_band(path, x_of(split.train.x), y_of(split.train.y),
                                     x_of(split.test.x), y_of(split.test.y), y_of(mean),
                                     epistemic_std * y_std, total_std * y_std)
