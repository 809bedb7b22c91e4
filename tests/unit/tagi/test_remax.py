"""Remax (docs/tagi.md, Remax): the closed form step by step, its properties, and Monte Carlo.

Remax is an approximation (log-normal moment matching), so Monte Carlo bounds are loose; the
exact formula is pinned by an independent scalar transcription of docs/tagi.md instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.tagi import HiddenStates, Remax
from tests.unit.tagi.helpers import F64, gen, monte_carlo


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _remax_reference(mu: list[float], var: list[float]) -> list[tuple[float, float, float]]:
    """docs/tagi.md's Remax for one sample, one scalar at a time (cuTAGI's MixtureReLU, unfloored)."""
    m_m, v_m, p = [], [], []
    for m, v in zip(mu, var):
        s = math.sqrt(v)
        a = m / s
        mt = m * _cdf(a) + s * _phi(a)
        vt = -mt * mt + 2 * mt * m - m * s * _phi(a) + (v - m * m) * _cdf(a)
        m_m.append(max(1e-6, mt))
        v_m.append(max(1e-6, vt))
        p.append(_cdf(a))
    m_t, v_t = sum(m_m), sum(v_m)
    v_ln_t = math.log(1 + v_t / m_t**2)
    m_ln_t = math.log(m_t) - v_ln_t / 2
    rows, m_hat = [], []
    for j in range(len(mu)):
        v_ln = math.log(1 + v_m[j] / m_m[j] ** 2)
        m_ln = math.log(m_m[j]) - v_ln / 2
        c = math.log(1 + v_m[j] / (m_t * m_m[j]))
        m_ln_a, v_ln_a = m_ln - m_ln_t, v_ln + v_ln_t - 2 * c
        m_hat.append(max(1e-6, math.exp(m_ln_a + v_ln_a / 2)))
        rows.append((v_ln_a, v_ln, c))
    out = []
    for j, (v_ln_a, v_ln, c) in enumerate(rows):
        m_a = m_hat[j] / sum(m_hat)
        v_a = (math.exp(v_ln_a) - 1) * m_a**2
        cov = (math.exp(v_ln - c) - 1) * m_a * m_m[j]
        out.append((m_a, v_a, min(math.sqrt(v_a * var[j]), cov / p[j]) / var[j]))
    return out


def test_remax_matches_the_scalar_transcription():
    g = gen(21)
    mu = torch.randn(4, 5, generator=g, dtype=F64)
    var = 0.05 + torch.rand(4, 5, generator=g, dtype=F64)
    out = Remax().forward(HiddenStates(mu, var))
    for b in range(4):
        ref = torch.tensor(_remax_reference(mu[b].tolist(), var[b].tolist()), dtype=F64)
        torch.testing.assert_close(out.mu_a[b], ref[:, 0], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(out.var_a[b], ref[:, 1], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(out.jcb[b], ref[:, 2], rtol=1e-9, atol=1e-12)


def test_remax_is_a_distribution_with_positive_variances():
    g = gen(22)
    mu = 3 * torch.randn(16, 10, generator=g, dtype=F64)
    var = torch.rand(16, 10, generator=g, dtype=F64) * 2
    out = Remax().forward(HiddenStates(mu, var))
    torch.testing.assert_close(out.mu_a.sum(1), torch.ones(16, dtype=F64))
    assert bool((out.mu_a > 0).all()) and bool((out.var_a >= 0).all())
    assert bool((out.jcb >= 0).all())


@pytest.mark.parametrize("var_scale,mean_tol,var_rtol,jcb_rtol", [
    (0.01, 2e-3, 0.05, 0.02),  # near-deterministic: the approximation is almost exact
    (0.1, 5e-3, 0.25, 0.12),  # moderate: what the log-normal matching is known to deliver
])
def test_remax_is_close_to_monte_carlo(var_scale, mean_tol, var_rtol, jcb_rtol):
    """A = ReLU(Z)/Σ ReLU(Z) by sampling; positive means so that the ratio is well defined."""
    mu = torch.tensor([[1.0, 2.0, 0.5, 3.0]], dtype=F64)
    var = torch.full_like(mu, var_scale)
    out = Remax().forward(HiddenStates(mu, var))
    z = mu + var.sqrt() * torch.randn(200_000, 1, 4, generator=gen(23), dtype=F64)
    a = torch.relu(z) / torch.relu(z).sum(-1, keepdim=True)
    mc = monte_carlo(a, z)
    assert (out.mu_a - mc.mean).abs().max().item() < mean_tol
    assert ((out.var_a - mc.var).abs() / mc.var).max().item() < var_rtol
    assert ((out.jcb - mc.jcb).abs() / mc.jcb.abs()).max().item() < jcb_rtol


def test_remax_rejects_image_states():
    with pytest.raises(ValueError, match=r"Remax.*\(batch, classes\).*\(2, 3, 4\)"):
        Remax().forward(HiddenStates(torch.zeros(2, 3, 4), torch.ones(2, 3, 4)))
