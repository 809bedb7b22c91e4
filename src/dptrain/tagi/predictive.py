"""What a heteroscedastic network predicts, per input and target, in the data's own units.

Shape legend: B batch, K targets; the network output is (B, 2K) in (mean, noise) pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class HeteroscedasticPrediction(NamedTuple):
    """Predictive mean and its two variances, each (B, K).

    `epistemic_var` is the model's uncertainty about the mean (shrinks with data);
    `aleatoric_var` is the expected observation noise E[σ²] at that input (does not);
    the predictive distribution of a new observation has variance their sum.
    """

    mean: torch.Tensor
    epistemic_var: torch.Tensor
    aleatoric_var: torch.Tensor

    @property
    def total_var(self) -> torch.Tensor:
        return self.epistemic_var + self.aleatoric_var


def split_heteros(mu: torch.Tensor, var: torch.Tensor, y_mean: torch.Tensor | float = 0.0,
                  y_scale: torch.Tensor | float = 1.0) -> HeteroscedasticPrediction:
    """Split an `EvenExp` output (mu, var) into mean, epistemic and aleatoric variance.

    If the targets were normalised as (y − y_mean)/y_scale for training, pass both to get the
    prediction in the data's units.
    """
    if mu.dim() != 2 or mu.shape[1] % 2 or var.shape != mu.shape:
        raise ValueError(f"split_heteros needs (batch, 2 x targets) mu and var, got "
                         f"{tuple(mu.shape)} and {tuple(var.shape)}")
    scale = torch.as_tensor(y_scale, dtype=mu.dtype, device=mu.device)
    shift = torch.as_tensor(y_mean, dtype=mu.dtype, device=mu.device)
    return HeteroscedasticPrediction(mean=mu[:, 0::2] * scale + shift,
                                     epistemic_var=var[:, 0::2] * scale * scale,
                                     aleatoric_var=mu[:, 1::2] * scale * scale)
