"""The two buffers that travel between TAGI layers: hidden states forward, innovations backward.

Shape legend (every tagi module): B batch, I input units, O output units, N units of a state,
L observations per sample (HRC), P flat parameter count; image states are (B, C, H, W) (NCHW).
Hidden states and innovations of one layer boundary always have the same shape: (B, N) after a
Linear, (B, C, H, W) after a convolution or pooling layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False, slots=True)
class HiddenStates:
    """Diagonal-Gaussian states of one layer boundary (pytagi's `BaseHiddenStates`).

    `jcb` is J = Cov(A, Z) / v_Z of the activation that produced the state, for the backward
    pass (docs/tagi.md). `None` means J = 1 everywhere (the output of a non-activation layer,
    or the network input) and saves a tensor and a multiply per layer.
    """

    mu_a: torch.Tensor  # (B, N) or (B, C, H, W)
    var_a: torch.Tensor | None  # same shape as mu_a; None = deterministic (all zeros)
    jcb: torch.Tensor | None = None  # same shape as mu_a; None = 1
    #: J is 0 or 1 everywhere (ReLU), so J² = J: a backward may scale δv by J once.
    jcb_is_mask: bool = False

    @property
    def batch_size(self) -> int:
        return self.mu_a.shape[0]

    def jcb_or_ones(self) -> torch.Tensor:
        """J as a tensor (materialised if it is the implicit 1)."""
        return torch.ones_like(self.mu_a) if self.jcb is None else self.jcb

    def var_or_zeros(self) -> torch.Tensor:
        """The variance as a tensor (materialised if the state is deterministic)."""
        return torch.zeros_like(self.mu_a) if self.var_a is None else self.var_a


@dataclass(eq=False, slots=True)
class DeltaStates:
    """Innovations (δm, δv) for a hidden state X (pytagi's `BaseDeltaStates`).

    Defined so that the posterior is `m_X|y = m_X + v_X δm` and `v_X|y = v_X + v_X² δv`
    (docs/tagi.md, Notation). Standard innovations have δv ≤ 0.
    """

    delta_mu: torch.Tensor | None = None  # same shape as the state; None before any update
    delta_var: torch.Tensor | None = None

    def copy_from(self, other: DeltaStates) -> None:
        """Take `other`'s innovations (pytagi's name): how an encoder receives what the decoder
        after it sent back to its input."""
        self.delta_mu, self.delta_var = (None if t is None else t.clone()
                                         for t in (other.delta_mu, other.delta_var))
