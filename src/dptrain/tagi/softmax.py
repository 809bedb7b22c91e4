"""Softmax output heads (docs/tagi.md, Softmax and ClosedFormSoftmax): per-sample normalisations
of a (B, N) state over its N units, for classification with one-hot observations and
`OutputUpdater.update`.

`Softmax` linearises at the mean; `ClosedFormSoftmax` matches the moments of exp(Z) and of
their sum through log-normals, as `Remax` does for its MixtureReLU. Shape legend: B batch,
N classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptrain.tagi.activations import Activation


def _check_classes(layer: Activation, mu_z: torch.Tensor) -> None:
    if mu_z.dim() != 2:
        raise ValueError(f"{layer.label}: expected input of shape (batch, classes), "
                         f"got {tuple(mu_z.shape)}")


class Softmax(Activation):
    """m_A = softmax(m_Z), J = m_A (1 − m_A), v_A = J² (v_Z + v_Z[argmax m_Z]), per sample.

    The linearised softmax of cuTAGI: each unit's own derivative, and the variance of the unit
    with the largest mean (the shift of the stable softmax) added to every unit's variance.
    The arg-max is the first largest mean of the sample. Deliberate difference from the
    pytagi 0.2.1 wheel, whose CPU layer normalises groups of B consecutive values of the flat
    batch instead of each sample's N values (see docs/tagi.md, Departures from pytagi).
    """

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check_classes(self, mu_z)
        mu_a = torch.softmax(mu_z, dim=1)  # (B, N), max-shifted by torch
        jcb = mu_a * (1.0 - mu_a)
        top = mu_z.argmax(dim=1, keepdim=True)  # (B, 1), the first maximum
        var_a = jcb * jcb * (var_z + var_z.gather(1, top))
        return mu_a, var_a, jcb


class ClosedFormSoftmax(Activation):
    """Closed-form moments of A_j = exp(Z_j) / Σ_k exp(Z_k), per sample (cuTAGI's
    `ClosedFormSoftmax`)::

        E_j = exp(Z_j):  m_E = exp(m_Z + v_Z/2),  v_E = m_E² (exp(v_Z) − 1)
        S = Σ E_j:       m_S = Σ m_E,  v_S = Σ v_E,  log-normal (m_lnS, v_lnS) of (m_S, v_S)
        c_j = Cov(Z_j, ln S) = log(1 + v_Ej / (m_S m_Ej))
        ln A_j = Z_j − ln S:  m_lnA = m_Z − m_lnS,  v_lnA = v_Z + v_lnS − 2 c_j
        m_A = exp(m_lnA + v_lnA/2),  v_A = (exp(v_lnA) − 1) m_A²,  J = m_A (v_Z − c_j)/v_Z

    Σ m_A is close to, not exactly, 1 (no renormalisation, as in cuTAGI; with variances of
    several units the log-normal matching breaks down and Σ m_A can be far above 1, where
    `Remax`, which renormalises, stays a distribution). v_lnA is floored at 0: for a unit that
    dominates its sample the three terms cancel and rounding can leave a negative variance,
    which cuTAGI passes on. Every exp(m_Z) is
    taken relative to the sample's largest mean, which cancels in every ratio above: the same
    numbers, without the overflow of exp(m_Z) for m_Z > 88 in float32. Where v_Z = 0 (or
    below the dtype's smallest normal number), J is its limit m_A (1 − m_Ej/m_S), the
    linearised softmax's derivative (cuTAGI divides 0 by 0 there).
    """

    def moments(self, mu_z: torch.Tensor, var_z: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check_classes(self, mu_z)
        shift = mu_z.amax(dim=1, keepdim=True)  # (B, 1)
        mu_e = torch.exp(mu_z - shift + 0.5 * var_z)  # (B, N), m_E / exp(shift)
        expm1_v = torch.expm1(var_z)
        mu_s = mu_e.sum(1, keepdim=True)  # (B, 1)
        var_s = (mu_e * mu_e * expm1_v).sum(1, keepdim=True)
        var_ln_s = torch.log1p(var_s / (mu_s * mu_s))
        mu_ln_s = torch.log(mu_s) - 0.5 * var_ln_s  # of S / exp(shift)
        share = mu_e / mu_s  # m_Ej / m_S
        cov = torch.log1p(share * expm1_v)  # c_j: v_Ej / (m_S m_Ej) = share · (exp(v_Z) − 1)
        # ≥ 0 as a variance; for a dominant unit (c_j ≈ v_Z ≈ v_lnS) rounding leaves ±1 ulp
        var_ln_a = (var_z + var_ln_s - 2.0 * cov).clamp_min_(0.0)
        mu_a = torch.exp(mu_z - shift - mu_ln_s + 0.5 * var_ln_a)
        var_a = torch.expm1(var_ln_a) * mu_a * mu_a
        tiny = torch.finfo(var_z.dtype).tiny  # below it, c_j / v_Z loses its digits
        ratio = torch.where(var_z > tiny, cov / var_z.clamp_min(tiny),
                            share)  # c_j / v_Z and its limit at v_Z = 0
        return mu_a, var_a, mu_a * (1.0 - ratio)


def masked_softmax_moments(mu_z: torch.Tensor, var_z: torch.Tensor, keep: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_A, v_A, J) of A = softmax(Z) over the last dimension, Z's entries independent
    Gaussians, where `keep` (broadcast to Z) is true; A = 0 elsewhere (a causal mask).

    `ClosedFormSoftmax`'s log-normal matching, but carried out on logarithms: every sum of
    exponentials is a logsumexp and every log(1 + x) of a ratio a softplus of its logarithm,
    so a score variance in the hundreds (an attention layer's early scores) stays finite where
    exp(v_Z) would overflow. Then, as a probability vector must: m_A is renormalised to sum to 1
    over the kept entries, v_A is at most m_A (1 − m_A) (the largest variance of a value in
    [0, 1] with mean m_A), and J at most sqrt(v_A / v_Z) (|Cov(A, Z)| ≤ sd(A) sd(Z)). With small
    variances it is the softmax of the means and J its derivative m_A (1 − m_A), unlike Remax,
    whose ReLU sends every negative score to a floor (docs/tagi.md, Attention weights).
    """
    dtype = mu_z.dtype
    keep = keep.expand_as(mu_z)
    never = torch.tensor(-torch.inf, dtype=dtype, device=mu_z.device)
    tiny = torch.finfo(dtype).tiny
    var_z = var_z.clamp_min(0.0)
    log_mu_e = torch.where(keep, mu_z + 0.5 * var_z, never)  # log E[exp(Z_j)]
    log_mu_s = torch.logsumexp(log_mu_e, -1, keepdim=True)  # log E[S], S = Σ exp(Z_j)
    # log(exp(v) − 1), −inf at v = 0: the log of v_E / m_E² = exp(v_Z) − 1
    log_expm1_v = torch.where(var_z > tiny,
                              var_z + torch.log(-torch.expm1(-var_z.clamp_min(tiny))), never)
    log_var_ratio = torch.logsumexp(torch.where(keep, 2.0 * log_mu_e + log_expm1_v, never), -1,
                                    keepdim=True) - 2.0 * log_mu_s  # log(v_S / m_S²)
    var_ln_s = F.softplus(log_var_ratio)
    mu_ln_s = log_mu_s - 0.5 * var_ln_s
    cov = F.softplus(log_mu_e + log_expm1_v - log_mu_s)  # Cov(Z_j, ln S)
    var_ln_a = (var_z + var_ln_s - 2.0 * cov).clamp_min(0.0)
    mu_a = torch.softmax(torch.where(keep, mu_z - mu_ln_s + 0.5 * var_ln_a, never), -1)
    # expm1 of at most 80 fits float32; the cap below holds v_A far lower anyway
    var_a = torch.minimum(torch.expm1(var_ln_a.clamp_max(80.0)) * mu_a * mu_a,
                          mu_a * (1.0 - mu_a))
    share = torch.exp(log_mu_e - log_mu_s)  # the limit of Cov(Z_j, ln S) / v_Z at v_Z = 0
    ratio = torch.where(var_z > tiny, cov / var_z.clamp_min(tiny), share)
    jcb = mu_a * (1.0 - ratio).clamp_min(0.0)
    # the bound where Z varies; at v_Z = 0 both sides are 0/0 and J is the derivative
    jcb = torch.where(var_z > tiny, torch.minimum(jcb, (var_a / var_z.clamp_min(tiny)).sqrt()),
                      jcb)
    zero = torch.zeros((), dtype=dtype, device=mu_z.device)
    return mu_a, torch.where(keep, var_a, zero), torch.where(keep, jcb, zero)
