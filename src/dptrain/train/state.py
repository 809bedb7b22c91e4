"""TrainState: what a checkpoint holds (its state file), as the Trainer writes and reads it.

    state = TrainState(learner=..., epoch=2, step=90, epoch_done=True, sampler=..., rng=[...],
                       early_stopping=..., history=[...])
    ckpt.commit(tmp, snapshot(state.to_dict()), state.meta(...))
    TrainState.from_dict(found.state)  # == state: what is written is what is read

The dictionary's layout is the checkpoints' format: `to_dict` writes it as every run before
wrote it, and `from_dict` reads those too (keys a newer run added are absent there and read as
their defaults), so runs written before still resume (tests/data/run_before_*).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    """A run's state at a checkpoint: the learner's part and the Trainer's."""

    learner: Any
    """The learner's own state (`Learner.save_checkpoint`; a sharded learner's names its
    shards, written beside the state file)."""
    epoch: int
    """The epoch the checkpoint was written in (0-based)."""
    step: int
    """Global (optimizer) steps done."""
    epoch_done: bool
    """Written at the epoch's end: a resumed run begins the next epoch."""
    sampler: dict[str, Any]
    """The train sampler's position in the epoch (`ShardedSampler.state_dict`)."""
    rng: list[Any]
    """Every rank's RNG states, by rank (`dptrain.train.rng.capture`)."""
    early_stopping: dict[str, Any]
    """`EarlyStopping.state_dict`: the monitor, its best value and epoch, the bad epochs."""
    history: list[dict[str, Any]]
    """epochs.csv's rows so far."""
    partial_sums: list[dict[str, Any]] | None = None
    """Every rank's (sum, count) per train metric of the epoch so far, by rank (empty dicts at
    an epoch's end); None in a checkpoint from before they were saved."""
    step_history: list[dict[str, Any]] | None = None
    """steps.csv's rows so far. This and the next two: a run counted in steps only (max_steps
    or val_every); None in a run counted in epochs, whose checkpoints never held them."""
    best_step: int | None = None
    """The global step of the validation point best/ holds."""
    point_sums: list[dict[str, Any]] | None = None
    """Every rank's (sum, count) per train metric since the last validation point, by rank."""

    @property
    def counts_steps(self) -> bool:
        """Whether the state is a run counted in steps (its checkpoints hold steps.csv)."""
        return self.step_history is not None

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's state file, as `ckpt.commit` writes it."""
        trainer: dict[str, Any] = {"epoch": self.epoch, "step": self.step,
                                   "epoch_done": self.epoch_done,
                                   "partial_sums": self.partial_sums}
        if self.counts_steps:
            trainer.update({"step_history": self.step_history, "best_step": self.best_step,
                            "point_sums": self.point_sums})
        return {"learner": self.learner, "sampler": self.sampler, "rng": self.rng,
                "early_stopping": self.early_stopping, "history": self.history,
                "trainer": trainer}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TrainState:
        """A checkpoint's state file as `to_dict` wrote it (or an older run did)."""
        trainer = state["trainer"]
        return cls(learner=state["learner"], epoch=trainer["epoch"], step=trainer["step"],
                   epoch_done=trainer["epoch_done"], sampler=state["sampler"],
                   rng=state["rng"], early_stopping=state["early_stopping"],
                   history=state["history"], partial_sums=trainer.get("partial_sums"),
                   step_history=trainer.get("step_history"),
                   best_step=trainer.get("best_step"), point_sums=trainer.get("point_sums"))

    def meta(self, *, world_size: int, config: dict[str, Any],
             run_record: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's meta.json: where the run was, on how many ranks, under which
        config (`TrainConfig.to_json`) and run record (what a resume must match)."""
        return {"step": self.step, "epoch": self.epoch, "epoch_done": self.epoch_done,
                "world_size": world_size, "config": config, "run_record": run_record,
                "sharded": run_record.get("sharded_checkpoint", False),
                "saved_at": time.time()}
