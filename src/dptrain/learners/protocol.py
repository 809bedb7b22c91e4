"""The contract between the Trainer and a learner. The Trainer knows nothing else about it.

A batch is a tuple `(inputs, targets)` of tensors holding this rank's share of one optimizer
step. Metrics come back as `{name: (sum, count)}` so that the Trainer's reduction over ranks
gives exact means however unevenly ranks hold samples (docs/design.md, contract 5).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from dptrain.dist import Runtime

Batch = tuple[torch.Tensor, torch.Tensor]
Metrics = dict[str, tuple[float, float]]


@runtime_checkable
class Learner(Protocol):
    """One training step and one evaluation step on a batch, and resumable state."""

    def setup(self, runtime: Runtime) -> None:
        """Move to `runtime.device` and make replicas identical (broadcast from rank 0).

        Called once by every rank, collectively, before the first step.
        """

    def train_step(self, batch: Batch) -> Metrics:
        """One optimizer step on this rank's share of the global batch; collective."""

    def eval_step(self, batch: Batch) -> Metrics:
        """Metrics of the current model on a batch; changes nothing; local (no collective)."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters (and buffers) as plain tensors with the names a
        non-distributed model of the same architecture would use; identical on every rank."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training exactly: model, optimizer, scheduler, ..."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on every rank)."""
