"""Remax: closed-form moments of a softmax-like normalisation, per sample (docs/tagi.md, Remax).

A_j = M_j / Σ_k M_k with M = MixtureReLU(Z), the ratio moment-matched through log-normals.
Shape legend: B batch, N classes; the input is (B, N) and the normalisation runs over N.
Use it as an output head with `OutputUpdater.update` and one-hot observations.
"""

from __future__ import annotations

import torch

from dptrain.tagi.activations import Activation
from dptrain.tagi.mixture import MIXTURE_FLOOR, MixtureReLU


def _log_normal(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_ln, v_ln) of the log-normal with mean `mu` and variance `var`."""
    var_ln = torch.log1p(var / (mu * mu))
    return torch.log(mu) - 0.5 * var_ln, var_ln


class Remax(Activation):
    """m_A ≥ 0 with Σ_j m_A = 1 per sample; J_j = min(sqrt(v_A v_Z), Cov(A_j, M_j)/Φ_j)/v_Z."""

    def __init__(self) -> None:
        super().__init__()
        self._relu = MixtureReLU()

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mu_z.dim() != 2:
            raise ValueError(f"{self.label}: expected input of shape (batch, classes), "
                             f"got {tuple(mu_z.shape)}")
        mu_m, var_m, cdf = self._relu.moments(mu_z, var_z)  # (B, N) each
        mu_mt = mu_m.sum(1, keepdim=True)  # (B, 1)
        var_mt = var_m.sum(1, keepdim=True)
        mu_ln_m, var_ln_m = _log_normal(mu_m, var_m)
        mu_ln_mt, var_ln_mt = _log_normal(mu_mt, var_mt)
        cov_ln = torch.log1p(var_m / (mu_mt * mu_m))  # Cov(ln M_j, ln M_t)
        mu_ln_a = mu_ln_m - mu_ln_mt
        # >= 0 exactly; one weight near 1 (a row with one score) rounds it a little below
        var_ln_a = (var_ln_m + var_ln_mt - 2.0 * cov_ln).clamp_min_(0.0)
        mu_a = torch.exp(mu_ln_a + 0.5 * var_ln_a).clamp_min_(MIXTURE_FLOOR)
        mu_a = mu_a / mu_a.sum(1, keepdim=True)
        var_a = torch.expm1(var_ln_a) * mu_a * mu_a
        cov_am = torch.expm1(var_ln_m - cov_ln) * mu_a * mu_m  # Cov(A_j, M_j)
        var_z = var_z.clamp_min(1e-30)
        bound = (var_a * var_z).sqrt()
        # Φ_j underflows to 0 for a score far below 0 (an attention score of a few tens):
        # the bound alone, as an infinite ratio would give, not the 0/0 of a vanished Cov
        ratio = torch.where(cdf > 0, cov_am / cdf, bound)
        jcb = torch.minimum(bound, ratio) / var_z
        return mu_a, var_a, jcb
