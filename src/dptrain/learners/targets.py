"""What a dataset's targets are, as a learner needs to be told: one class per position of the
input window, or one target per sample.

    per_position_targets(split)   # True for token data: (B, T) next tokens for (B, T) windows
"""

from __future__ import annotations

from typing import Any

import torch


def per_position_targets(split: Any) -> bool:
    """The targets are one class per position of the input window: token data (a language
    model's next tokens, `split.vocabulary`), or classification data of your own whose target
    per sample is a vector of class ids (`dptrain.data.datasets.user_data`)."""
    if split.vocabulary is not None:
        return True
    if split.task != "classification":
        return False
    y = getattr(split.train, "y", None)
    if isinstance(y, torch.Tensor):
        return y.dim() == 2 and not y.is_floating_point()
    first = torch.as_tensor(split.train[0][1])
    return first.dim() == 1 and not first.is_floating_point()
