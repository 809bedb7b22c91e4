"""What a model family adds to the Trainer's generic report.

    extras = MetricExtras(positions_per_sample=256, monitor="loss",
                          summary={"vocabulary": {"kind": "char", "size": 65}})
    Trainer(learner, split, config, runtime, extras=extras).fit()

The Trainer reports what any learner reports on any data: the learner's metrics per part,
samples per second, checkpoints' pauses. A family whose samples each hold several predicted
positions, with a loss per position (a language model: a window of tokens), says so here and
the Trainer derives the figures per position from it; the model's family builds it
(`dptrain.models.metric_extras`). The default adds nothing.

The figures keep the names runs have always written (steps.csv's `tokens` column,
summary.json's `tokens_seen`, `tokens_per_s`, `mfu`), whatever the family calls a position.
"""

from __future__ import annotations

from dptrain.models.spec import MetricExtras

__all__ = ["MetricExtras", "NONE"]

NONE = MetricExtras()
"""A family that adds nothing: the Trainer's default."""
