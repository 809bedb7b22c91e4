"""What a model family adds to the Trainer's generic report.

    extras = MetricExtras(unit="character", positions_per_sample=256, monitor="loss",
                          summary={"vocabulary": {"kind": "char", "size": 65}})
    Trainer(learner, split, config, runtime, extras=extras).fit()

The Trainer reports what any learner reports on any data: the learner's metrics per part,
samples per second, checkpoints' pauses. A family whose samples each hold several predicted
positions, with a loss per position (a language model: a window of tokens), says so here and
the Trainer derives the figures per position from it; the caller builds it (`dptrain train`:
`dptrain.train.job.metric_extras`). The default adds nothing.

The figures keep the names runs have always written (steps.csv's `tokens` column,
summary.json's `tokens_seen`, `tokens_per_s`, `mfu`), whatever the family calls a position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dptrain.errors import ConfigError


@dataclass(frozen=True)
class MetricExtras:
    """What a model family adds to the Trainer's generic report."""

    unit: str | None = None
    """What one predicted position is (character, byte, token): each part's perplexity and
    bits per `unit` are derived from its per-position `loss` (nats), `{part}_perplexity` and
    `{part}_bits_per_{unit}` (`dptrain.train.metric_names.derived`). None: no such metrics."""
    positions_per_sample: int | None = None
    """Predictions per sample (a language model's positions per window): the positions seen
    (steps.csv's `tokens`, summary.json's `tokens_seen`), positions per second of training
    (`tokens_per_s`, also on the progress bar) and, for a model that declares its FLOPs per
    position (`Learner.flops_per_token`), the MFU. None: none of these."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Extra summary.json entries, as they are (e.g. the vocabulary's kind and size, the
    unknown characters met in each part)."""
    monitor: str | None = None
    """The family's default metric that chooses, without its part's prefix ("loss": val_loss),
    where the task's default (val_error, val_rmse) does not fit; None: the task's."""

    def __post_init__(self) -> None:
        if self.positions_per_sample is not None and self.positions_per_sample < 1:
            raise ConfigError(f"positions_per_sample must be >= 1 (or None), got "
                              f"{self.positions_per_sample}")
        if self.monitor is not None and self.monitor.startswith(("train_", "val_", "test_")):
            raise ConfigError(f"MetricExtras.monitor names a metric without its part "
                              f"(loss, not val_loss), got {self.monitor!r}")


NONE = MetricExtras()
"""A family that adds nothing: the Trainer's default."""
