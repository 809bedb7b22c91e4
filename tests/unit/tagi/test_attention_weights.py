"""The attention's softmax weights (`MultiheadAttention(weights="softmax")`,
`masked_softmax_moments`, docs/tagi.md, Attention weights): the closed-form moments of a
softmax of Gaussian scores, checked against sampling, against the softmax of the means where
the variances vanish, and where a score's variance is in the thousands."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import MultiheadAttention, manual_seed
from dptrain.tagi.remax import Remax
from dptrain.tagi.softmax import ClosedFormSoftmax, masked_softmax_moments
from dptrain.tagi.states import HiddenStates

F64 = torch.float64


def _scores(rows: int, n: int, mean_sd: float, var: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g, dtype=F64) * mean_sd,
            torch.full((rows, n), var, dtype=F64))


@pytest.mark.parametrize("mean_sd, var", [(1.0, 0.1), (0.3, 0.3), (1.0, 1.0), (3.0, 0.5)])
def test_the_moments_are_the_softmax_s_as_sampling_gives_them(mean_sd, var):
    """Mean, variance and Cov(A_j, Z_j)/v_Z of softmax(Z) for 64 Gaussian scores against
    200,000 draws, where the log-normal matching holds (variances up to ~1): means within 8 %,
    standard deviations and Jacobians within 40 % (the matching's largest errors are those of
    a weight that dominates its row), and the means several times closer than Remax's, which
    are those of ReLU(Z) / Σ ReLU(Z)."""
    mu, v = _scores(1, 64, mean_sd, var)
    m_a, v_a, jcb = masked_softmax_moments(mu, v, torch.ones(1, 64, dtype=torch.bool))
    z = mu + v.sqrt() * torch.randn(200_000, 64, generator=torch.Generator().manual_seed(1),
                                    dtype=F64)
    a = torch.softmax(z, -1)
    cov = ((a - a.mean(0)) * (z - mu)).mean(0) / var
    big = a.mean(0) > 0.005  # the weights that matter; tiny ones are noise in the draws
    assert m_a.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert torch.allclose(m_a[0, big], a.mean(0)[big], rtol=0.08)
    assert torch.allclose(v_a[0, big].sqrt(), a.std(0)[big], rtol=0.4)
    assert torch.allclose(jcb[0, big], cov[big], rtol=0.4, atol=1e-4)
    remax = Remax().moments(mu, v)[0]
    ours, theirs = ((m[0, big] - a.mean(0)[big]).abs().max() for m in (m_a, remax))
    assert ours < theirs / 3


def test_without_variance_it_is_the_softmax_of_the_means_and_its_derivative():
    mu, _ = _scores(3, 10, 2.0, 0.0)
    keep = torch.arange(10)[None, :] <= torch.tensor([[2], [5], [9]])
    m_a, v_a, jcb = masked_softmax_moments(mu, torch.zeros_like(mu), keep)
    want = torch.softmax(mu.masked_fill(~keep, -torch.inf), -1)
    assert torch.allclose(m_a, want, atol=1e-15)
    assert torch.equal(v_a, torch.zeros_like(v_a))
    assert torch.allclose(jcb, want * (1 - want), atol=1e-15)
    assert torch.equal(m_a[~keep], torch.zeros_like(m_a[~keep]))  # masked: no weight at all


def test_huge_score_variances_stay_a_distribution():
    """Variances in the thousands (an untrained layer's scores): the cuTAGI form overflows,
    these stay finite, sum to 1, and v_A ≤ m_A(1 − m_A), J ≤ sqrt(v_A / v_Z)."""
    mu, v = _scores(4, 64, 5.0, 3000.0)
    v = v.float() * torch.linspace(0.01, 1.0, 64)
    mu = mu.float()
    assert not torch.isfinite(ClosedFormSoftmax().moments(mu, v)[1]).all()
    m_a, v_a, jcb = masked_softmax_moments(mu, v, torch.ones(64, dtype=torch.bool))
    assert all(torch.isfinite(t).all() for t in (m_a, v_a, jcb))
    assert torch.allclose(m_a.sum(-1), torch.ones(4), atol=1e-5)
    assert (v_a <= m_a * (1 - m_a) + 1e-7).all()
    assert (jcb <= (v_a / v).sqrt() + 1e-7).all() and (jcb >= 0).all()


def test_softmax_attention_is_causal_and_refuses_an_unknown_weighting():
    """The layer with softmax weights: an output at position t moves with no later token (mean
    and variance, bit for bit), one at a later position does; an unknown `weights` is refused."""
    manual_seed(0)
    layer = MultiheadAttention(8, 2, use_rope=True, max_seq_len=6, weights="softmax",
                               dtype=F64)
    x = torch.randn(2, 6 * 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    out = layer.forward(HiddenStates(x, torch.full_like(x, 0.1), None))
    changed = x.clone()
    changed[:, 4 * 8:] += 1.0
    again = layer.forward(HiddenStates(changed, torch.full_like(x, 0.1), None))
    assert torch.equal(again.mu_a[:, :4 * 8], out.mu_a[:, :4 * 8])
    assert torch.equal(again.var_a[:, :4 * 8], out.var_a[:, :4 * 8])
    assert not torch.equal(again.mu_a[:, 4 * 8:], out.mu_a[:, 4 * 8:])
    with pytest.raises(ValueError, match="weights must be one of"):
        MultiheadAttention(8, 2, weights="sparsemax")
