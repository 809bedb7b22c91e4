"""The contract between the Trainer and a learner: everything the Trainer calls, and nothing else.

A batch is a tuple `(inputs, targets)` of tensors holding this rank's share of one optimizer
step. Metrics come back as `{name: (sum, count)}` so that the Trainer's reduction over ranks
gives exact means however unevenly ranks hold samples (docs/design.md, contract 5).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from dptrain.runtime import Runtime

if TYPE_CHECKING:
    from dptrain.data import Split

Batch = tuple[torch.Tensor, torch.Tensor]
Metrics = dict[str, tuple[float, float]]


@runtime_checkable
class Learner(Protocol):
    """One training step and one evaluation step on a batch, resumable state, and its report."""

    eval_is_collective: bool
    """True when `eval_step` communicates (a sharded model gathers its weights), so every rank
    must call it equally often; a rank with no samples left then passes an empty batch."""

    uneven_last_batch: bool
    """True when `train_step` computes the global batch's update exactly however the batch is
    split over the ranks, a rank with no sample included (it gets an empty batch and still
    takes part in every collective of the step). The Trainer's train sampler then neither pads
    nor drops: each epoch's last global batch holds just the samples left, split unevenly, and
    a run computes the same steps on any world size. False: the last global batch is padded by
    wrapping around, so every rank gets an equal share (up to world size - 1 samples seen twice
    per epoch). Read before `setup`."""

    def setup(self, runtime: Runtime) -> None:
        """Move to `runtime.device` and make replicas identical (broadcast from rank 0).

        Called once by every rank, collectively, before the first step.
        """

    def set_epoch(self, epoch: int) -> None:
        """Called by every rank before each epoch (from 0), also after a resume: per-epoch
        schedules (TAGI's σ_v) are functions of it."""

    def train_step(self, batch: Batch) -> Metrics:
        """One optimizer step on this rank's share of the global batch; collective."""

    def step_scalars(self) -> dict[str, float]:
        """After `train_step`: values of that step to log as they are, not summed over
        samples or ranks (the learning rate it applied, the same on every rank); {} if none.
        TensorBoard gets each step's, epochs.csv the last step's of each epoch."""

    def eval_step(self, batch: Batch) -> Metrics:
        """Metrics of the current model on a batch; changes nothing; local unless
        `eval_is_collective`."""

    def end_training(self, means: dict[str, float]) -> dict[str, float]:
        """Every rank, after each training epoch, with the means of `train_step`'s metrics over
        the epoch's samples (a resumed epoch's included): the metrics to report. A learner may
        take out terms it keeps for itself, named with a leading "_" (TAGI chooses its
        class-probability link from them), before the evaluation that follows."""

    def end_evaluation(self, means: dict[str, float], part: str = "test") -> dict[str, float]:
        """Every rank, after each evaluation, with the means of `eval_step`'s metrics over every
        sample of `part` ("val" or "test"): the metrics to report, with terms that only make
        sense summed over the whole part (calibration bins) turned into their metric (`ece`).
        A learner may choose from the "val" part (TAGI's link), never from "test"."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters (and buffers) as plain tensors with the names a
        non-distributed model of the same architecture would use; identical on every rank."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training exactly: model, optimizer, scheduler, ..."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on every rank)."""

    def save_checkpoint(self, directory: Path, *, background: bool = False) -> dict[str, Any]:
        """Collective: the learner's part of a checkpoint being written to `directory` (the
        same path on every rank). Returns the state rank 0 stores in the checkpoint's state
        file; a learner that writes files of its own (each rank its shards) writes them under
        `directory`, which then must be on a filesystem every rank shares. With `background`
        it may still be writing them when it returns, from a copy taken before it returns (the
        next steps may change the model): `checkpoint_written` waits for them."""

    def checkpoint_written(self) -> None:
        """Block until the files of the last `save_checkpoint(background=True)` are complete on
        every rank, or raise `CheckpointError`; at once when none are being written. Every rank
        calls it before the next `save_checkpoint`, and rank 0 before it publishes the
        checkpoint; it may run in a thread other than the training thread."""

    def load_checkpoint(self, state: dict[str, Any], directory: Path) -> None:
        """Collective: restore from what `save_checkpoint` returned (`state`, the same on every
        rank) and wrote (`directory`)."""

    @property
    def run_record(self) -> dict[str, Any]:
        """What about this learner defines a run beyond its options (JSON values), stored in
        every checkpoint: resuming a run whose record differs is refused."""

    def flops_per_token(self) -> tuple[float, torch.dtype] | None:
        """The model's training FLOPs per token and the dtype its products run in, for the
        model FLOPs utilisation; None when the model declares none (it is not a language
        model that counts them)."""

    def report(self, out_dir: Path | None, split: Split) -> dict[str, Any]:
        """Every rank, once, after the last evaluation: entries for the run's summary. Rank 0
        passes the run directory and the learner writes its own plots there (a reliability
        diagram, a regression band); the others pass None."""
