"""Moment-matched activations (docs/tagi.md): exact mean, variance and J = Cov(A, Z)/v_Z of
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
        # variance to cancellation between two O(m²) terms when m ≫ s. (α Φ)(α Φ(−α)) rather
        # than α² Φ Φ(−α): α² overflows float32 for a large mean with a near-zero variance.
        ratio = cdf + alpha * pdf * (cdf_neg - cdf) + (alpha * cdf) * (alpha * cdf_neg) - pdf * pdf
        var_a = (var_z * ratio).clamp_min_(MIXTURE_FLOOR)
        return mu_tilde.clamp_min(MIXTURE_FLOOR), var_a, cdf


def _hard_tanh_moments(mu_z: torch.Tensor, var_z: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_T, v_T unfloored, J) of T = clip(Z, −1, 1) (docs/tagi.md, Activations).

    The same quantities as cuTAGI's `m_T = (m+1)P_l + (m−1)P_u + s(p_l − p_u) − m` and its v_T,
    computed around k = clip(m_Z, −1, 1): E[T − k] and E[(T − k)²] have no m² terms, which in
    float32 cancel catastrophically once |m_Z| is a few units (v_T = 2 instead of 0 at
    m_Z = 1e5). J = P(−1 < Z < 1) = Φ(a_l) + Φ(a_u) − 1 (Stein's lemma).
    """
    var_z = var_z.clamp_min(_TINY_VAR)
    std_z = var_z.sqrt()
    k = mu_z.clamp(-1.0, 1.0)
    dist = mu_z - k  # 0 inside [−1, 1]
    lo = (-1.0 - mu_z) / std_z  # −a_l
    hi = (1.0 - mu_z) / std_z  # a_u
    below, above = torch.special.ndtr(lo), torch.special.ndtr(-hi)  # P(Z < −1), P(Z > 1)
    # P(−1 < Z < 1) from the two small tail probabilities on the side where they are small.
    inside = torch.where(mu_z > 0, torch.special.ndtr(hi) - below,
                         torch.special.ndtr(-lo) - above)
    pdf_lo, pdf_hi = _normal_pdf(lo), _normal_pdf(hi)
    pdf_diff = std_z * (pdf_lo - pdf_hi)
    e1 = (-1.0 - k) * below + (1.0 - k) * above + dist * inside + pdf_diff  # E[T − k]
    e2 = ((1.0 + k) ** 2 * below + (1.0 - k) ** 2 * above + (dist * dist + var_z) * inside
          + 2.0 * dist * pdf_diff + var_z * (lo * pdf_lo - hi * pdf_hi))  # E[(T − k)²]
    return k + e1, e2 - e1 * e1, inside


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
