"""TrainConfig: how the Trainer trains (every field is stored in each checkpoint and in
summary.json).

    TrainConfig(out_dir=Path("runs/x"), epochs=5, batch_size=64, val_every=100)

Its fields that are options of `dptrain train` carry the names of `FitOptions`' fields
(`FROM_FIT`), so the fit section reaches the Trainer as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from dptrain.data.mixing import Mixing
from dptrain.errors import ConfigError
from dptrain.train.faults import FailAt


FROM_FIT = ("epochs", "batch_size", "seed", "max_steps", "val_every", "val_batches",
            "peak_flops", "checkpoint_every", "keep_last", "resume", "patience", "progress")
"""The fields of `TrainConfig` that are `FitOptions`' of the same name and value (the others
are the Trainer's own, or resolved first: out -> out_dir, the monitored metric, fail_at)."""

RENAMED = {"num_epochs": "epochs", "global_batch_size": "batch_size"}
"""Fields of `TrainConfig` under the names a checkpoint's or summary.json's "config" written
before holds them (`saved_config`)."""


def saved_config(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A "config" read back from a checkpoint or summary.json, under today's field names."""
    return {RENAMED.get(name, name): value for name, value in saved.items()}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train; every field is stored in each checkpoint and in summary.json."""

    out_dir: Path
    """Run directory: checkpoints/, epochs.csv, tb/, plots, summary.json."""
    epochs: int = 10
    """Epochs to train (not used with max_steps)."""
    batch_size: int = 32
    """Samples of one step over all ranks (the global batch); each rank takes batch_size /
    world_size of them (its local batch). Because rank r takes every world_size-th index of one
    shared permutation, the global batch of step k is the same samples at any world size (up to
    the wrap-around padding of an epoch's last step, for a learner that needs equal shards), and
    a run resumes on any world size that divides it, mid-epoch included."""
    seed: int = 0
    """Seeds the data order and every RNG (rank r draws from seed + r)."""
    checkpoint_every: int | None = None
    """Also checkpoint every this many steps (one is always written at each epoch end)."""
    keep_last: int = 3
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest valid checkpoint in out_dir, if any."""
    monitor: str = ""
    """The metric that chooses the best epoch (best/) and stops early; empty: the task's
    validation metric (val_error, val_rmse, val_series_nrmse for several time series; the
    model family's where it names one, `MetricExtras.monitor`) when the split has a
    validation part, else
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
    `epochs` epochs (then not used)."""
    val_every: int | None = None
    """Validate every this many global steps, and at the run's end, instead of at each epoch
    end; best/ and early stopping (patience in validation points) follow these points, and each
    writes a checkpoint. The test part is evaluated at the end only."""
    val_batches: int | None = None
    """Validate on this many global batches (batch_size samples each) of the validation
    part: a seeded choice over the whole part, the same at every point and on every world size
    (`dptrain.train.steps.validation_indices`); None: all of it."""
    peak_flops: float | None = None
    """FLOP/s of one device for the model FLOPs utilisation (mfu); None: the CUDA device's from
    a table, or measured on this CPU at the start. Only for a model that declares its FLOPs
    per predicted position (`Learner.flops_per_token`) and data whose positions per sample the
    caller gives (`MetricExtras.positions_per_sample`)."""
    record: dict[str, Any] = field(default_factory=dict)
    """What built this run (the CLI's options), stored for the record."""
    run_record: dict[str, Any] = field(default_factory=dict)
    """The options that define this run (JSON values: model and its sizes, data, learner
    options...). Each checkpoint stores them with the Trainer's own (batch size, seed, the
    model's parameter names and shapes); resuming from a checkpoint whose record differs is
    refused, naming each difference, before anything is loaded: one run per directory. Leave
    out what may change on resume (epochs, patience, ...)."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "keep_last", "eval_batch_size"):
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
