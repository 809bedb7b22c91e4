"""Early stopping on a monitored metric, with the state a checkpoint needs."""

from __future__ import annotations

import math
from typing import Any, Literal

from dptrain.errors import ConfigError


class EarlyStopping:
    """Stop after `patience` evaluations without improving the best value by `min_delta`.

    `patience=None` never stops but still tracks the best epoch (for the best checkpoint);
    `monitor=""` monitors nothing: no epoch is ever the best, none stops the run.
    """

    def __init__(self, monitor: str, *, mode: Literal["min", "max"] = "min",
                 patience: int | None = None, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"early stopping mode must be 'min' or 'max', got {mode!r}")
        if patience is not None and patience < 1:
            raise ConfigError(f"patience must be >= 1 (or None), got {patience}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.best_epoch: int | None = None
        self.bad_epochs = 0

    def update(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Record `epoch`'s metrics; True when this epoch is the new best."""
        if not self.monitor:
            return False
        if self.monitor not in metrics:
            raise ConfigError(f"early stopping monitors {self.monitor!r}, but the evaluation "
                              f"gave only {sorted(metrics)}")
        value = metrics[self.monitor]
        improved = (value < self.best - self.min_delta if self.mode == "min"
                    else value > self.best + self.min_delta)
        if improved:
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
        else:
            self.bad_epochs += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad_epochs >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "best": self.best, "best_epoch": self.best_epoch,
                "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.bad_epochs = state["bad_epochs"]
