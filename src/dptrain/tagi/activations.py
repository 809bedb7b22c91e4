"""Linearised activations (docs/tagi.md, Activations): m_A = f(m_Z), J = f'(m_Z), v_A = J² v_Z.

Shape legend: any state shape, (B, N) or (B, C, H, W); everything is elementwise.

Deliberate difference (docs/tagi.md, Departures from pytagi): an activation multiplies its J by
the incoming J, so two activations in a row compose their Jacobians instead of the second
overwriting the first. After a parametric layer the incoming J is 1 and nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptrain.tagi.base import Layer, constant
from dptrain.tagi.states import HiddenStates


class Activation(Layer):
    """Elementwise activation: subclasses return (m_A, v_A, J) from (m_Z, v_Z)."""

    is_activation = True

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_a, var_a, jcb = self.moments(states.mu_a, states.var_or_zeros())
        if states.jcb is not None:
            jcb = jcb * states.jcb
        return HiddenStates(mu_a, var_a, jcb)


class ReLU(Activation):
    """m_A = max(m_Z, 0), J = 1[m_Z > 0], v_A = J v_Z."""

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu_a = torch.relu(mu_z)
        jcb = torch.sign(mu_a)  # 1 where m_Z > 0, else 0: one op, in the state's dtype
        return mu_a, var_z * jcb, jcb

    def forward(self, states: HiddenStates) -> HiddenStates:
        out = super().forward(states)
        # J ∈ {0, 1}, so J² = J; a product with an incoming J keeps that only if it had it too.
        out.jcb_is_mask = states.jcb is None or states.jcb_is_mask
        return out


class LeakyReLU(Activation):
    """m_A = m_Z or α m_Z, J = 1 or α, v_A = J² v_Z (α = 0.1 as in cuTAGI).

    This is the intended math; cuTAGI's CPU LeakyReLU is a no-op (see docs/tagi.md).
    """

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = float(alpha)
        super().__init__()

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        jcb = (mu_z > 0).to(mu_z.dtype).mul_(1.0 - self.alpha).add_(self.alpha)
        return mu_z * jcb, var_z * jcb * jcb, jcb

    def __repr__(self) -> str:
        return f"LeakyReLU(alpha={self.alpha})"


class Sigmoid(Activation):
    """m_A = σ(m_Z), J = σ(1 − σ), v_A = J² v_Z."""

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu_a = torch.sigmoid(mu_z)
        jcb = mu_a * (1.0 - mu_a)
        return mu_a, var_z * jcb * jcb, jcb


class Tanh(Activation):
    """m_A = tanh(m_Z), J = 1 − tanh², v_A = J² v_Z."""

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu_a = torch.tanh(mu_z)
        jcb = 1.0 - mu_a * mu_a
        return mu_a, var_z * jcb * jcb, jcb


class Softplus(Activation):
    """m_A = log(1 + e^{m_Z}), J = σ(m_Z), v_A = J² v_Z.

    (pytagi 0.2.1's `nn.Softplus` cannot be constructed, see docs/tagi.md; this is the
    C++ layer's math.)
    """

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        jcb = torch.sigmoid(mu_z)
        return F.softplus(mu_z), var_z * jcb * jcb, jcb


class EvenExp(Activation):
    """Heteroscedastic head: outputs come in pairs (mean, noise variance) per target.

    Even positions (0, 2, ...) pass through unchanged, incoming J included. Odd positions hold
    the log of the observation noise variance before the layer and T = exp(Z) after it, with
    the log-normal moments m_T = exp(m_Z + v_Z/2), v_T = exp(2 m_Z + v_Z)(exp(v_Z) − 1) and
    J = Cov(T, Z)/v_Z = m_T.

    Deliberate difference from the pytagi 0.2.1 wheel: it uses J = v_Z m_T (the covariance,
    not divided by v_Z), which cuTAGI later corrected; see docs/tagi.md, Heteroscedastic
    regression.
    """

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mu_z.dim() != 2 or mu_z.shape[1] % 2:
            raise ValueError(f"EvenExp needs (batch, 2 x targets) states laid out as (mean, "
                             f"noise) pairs, got shape {tuple(mu_z.shape)}")
        pairs = (mu_z.shape[0], mu_z.shape[1] // 2, 2)
        mu_mean, mu_log_noise = mu_z.reshape(pairs).unbind(2)
        var_mean, var_log_noise = var_z.reshape(pairs).unbind(2)
        mu_t = torch.exp(mu_log_noise + constant(0.5, var_z) * var_log_noise)
        var_t = mu_t * mu_t * torch.expm1(var_log_noise)
        return (torch.stack([mu_mean, mu_t], 2).view(mu_z.shape),
                torch.stack([var_mean, var_t], 2).view(mu_z.shape),
                torch.stack([torch.ones_like(mu_t), mu_t], 2).view(mu_z.shape))
