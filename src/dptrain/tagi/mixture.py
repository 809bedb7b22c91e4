"""Moment-matched activations (TAGI_MATH.md §3): exact mean, variance and J = Cov(A, Z)/v_Z of
ReLU, hard-tanh clip(Z, −1, 1) and hard-sigmoid (clip(Z, −1, 1) + 1)/2 of a Gaussian Z.

Shape legend: any state shape, (B, N) or (B, C, H, W); everything is elementwise.
"""

from __future__ import annotations

import math

import torch

from dptrain.tagi.activations import Activation

#: Floor of the means and variances of the mixture activations, as in cuTAGI.
MIXTURE_FLOOR = 1e-6
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# A zero input variance (a deterministic unit) would make α = m/s undefined; clamping v_Z here
# gives the deterministic limit instead of NaN.
_TINY_VAR = 1e-30


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x).mul_(_INV_SQRT_2PI)


class MixtureReLU(Activation):
    """Rectified-Gaussian moments: m_A = max(1e-6, μ̃), μ̃ = m Φ(α) + s φ(α), α = m/s,
    v_A = max(1e-6, E[ReLU(Z)²] − μ̃²), J = Φ(α)."""

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        var_z = var_z.clamp_min(_TINY_VAR)
        std_z = var_z.sqrt()
        alpha = mu_z / std_z
        cdf = torch.special.ndtr(alpha)
        cdf_neg = torch.special.ndtr(-alpha)  # 1 − Φ(α) without cancellation
        pdf = _normal_pdf(alpha)
        mu_tilde = std_z * (alpha * cdf + pdf)
        # E[ReLU(Z)²] − μ̃² = v [Φ + αφ(1 − 2Φ) + α² Φ(α) Φ(−α) − φ²]: the same quantity as
        # cuTAGI's `−μ̃² + 2μ̃m − m s φ + (v − m²)Φ`, written so that float32 does not lose the
        # variance to cancellation between two O(m²) terms when m ≫ s.
        ratio = cdf + alpha * pdf * (cdf_neg - cdf) + alpha * alpha * cdf * cdf_neg - pdf * pdf
        var_a = (var_z * ratio).clamp_min_(MIXTURE_FLOOR)
        return mu_tilde.clamp_min(MIXTURE_FLOOR), var_a, cdf


def _hard_tanh_moments(mu_z: torch.Tensor, var_z: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_T, v_T unfloored, J) of T = clip(Z, −1, 1), in cuTAGI's form (TAGI_MATH.md §3)."""
    var_z = var_z.clamp_min(_TINY_VAR)
    std_z = var_z.sqrt()
    a_l = (1.0 + mu_z) / std_z
    a_u = (1.0 - mu_z) / std_z
    cdf_l, cdf_u = torch.special.ndtr(a_l), torch.special.ndtr(a_u)
    pdf_l, pdf_u = _normal_pdf(a_l), _normal_pdf(a_u)
    mu_sq = mu_z * mu_z
    mu_t = (mu_z + 1.0) * cdf_l + (mu_z - 1.0) * cdf_u + std_z * (pdf_l - pdf_u) - mu_z
    var_t = (cdf_l * (var_z - mu_sq - 2.0 * mu_z - 1.0)
             + cdf_u * (var_z - mu_sq + 2.0 * mu_z - 1.0)
             + std_z * (pdf_u * (mu_z - 1.0) - pdf_l * (mu_z + 1.0))
             - mu_t * mu_t + 2.0 * mu_t * mu_z + mu_sq - var_z + 2.0)
    return mu_t, var_t, cdf_l + cdf_u - 1.0


class MixtureTanh(Activation):
    """Moments of clip(Z, −1, 1): J = Φ(a_l) + Φ(a_u) − 1, a_l = (1+m)/s, a_u = (1−m)/s."""

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu_t, var_t, jcb = _hard_tanh_moments(mu_z, var_z)
        return mu_t, var_t.clamp_min_(MIXTURE_FLOOR), jcb


class MixtureSigmoid(Activation):
    """Moments of (clip(Z, −1, 1) + 1)/2: m = m_T/2 + 1/2, v = max(1e-6, v_T/4), J = J_T/2."""

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu_t, var_t, jcb = _hard_tanh_moments(mu_z, var_z)
        return (mu_t.mul_(0.5).add_(0.5), var_t.mul_(0.25).clamp_min_(MIXTURE_FLOOR),
                jcb.mul_(0.5))
