"""Linear layer against oracles: Monte Carlo forward moments, the dense (docs/tagi.md, Linear)
formulas, the exact Bayesian-linear-regression posterior, and init (Initialisation)."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.tagi import HiddenStates, Linear, Sequential, manual_seed
from dptrain.tagi.states import DeltaStates
from tests.unit.tagi.helpers import F64, assert_close_mc, gen, monte_carlo, regression_step


def _layer(seed: int, in_features: int = 3, out_features: int = 2) -> Linear:
    manual_seed(seed)
    layer = Linear(in_features, out_features, dtype=F64)
    g = gen(seed + 100)
    # Comparable magnitudes for every term of v_Z, so that dropping any one of them shows.
    layer.mu_w.copy_(torch.randn(out_features, in_features, generator=g, dtype=F64))
    layer.var_w.copy_(0.1 + 0.4 * torch.rand(out_features, in_features, generator=g, dtype=F64))
    layer.mu_b.copy_(torch.randn(out_features, generator=g, dtype=F64))
    layer.var_b.copy_(0.1 + 0.4 * torch.rand(out_features, generator=g, dtype=F64))
    return layer


def test_forward_moments_match_monte_carlo():
    """m_Z, v_Z are the exact mean and variance of W A + B for independent Gaussians."""
    layer = _layer(0)
    g = gen(1)
    mu_a = torch.tensor([[0.8, -1.2, 0.5], [0.0, 0.3, -0.7]], dtype=F64)  # (B=2, I=3)
    var_a = torch.tensor([[0.3, 0.2, 0.5], [0.6, 0.1, 0.4]], dtype=F64)
    out = layer.forward(HiddenStates(mu_a, var_a))
    n = 400_000
    a = mu_a + var_a.sqrt() * torch.randn(n, 2, 3, generator=g, dtype=F64)  # (n, B, I)
    w = layer.mu_w + layer.var_w.sqrt() * torch.randn(n, 2, 3, generator=g, dtype=F64)  # (n,O,I)
    b = layer.mu_b + layer.var_b.sqrt() * torch.randn(n, 2, generator=g, dtype=F64)
    z = torch.einsum("nbi,noi->nbo", a, w) + b[:, None, :]  # (n, B, O)
    mc = monte_carlo(z, z)
    assert_close_mc(out.mu_a, mc.mean, mc.mean_se, "Linear m_Z")
    assert_close_mc(out.var_a, mc.var, mc.var_se, "Linear v_Z")
    assert out.jcb is None  # J = 1 after a non-activation layer


def test_deterministic_input_skips_nothing():
    """var_a=None (the network input) gives the same v_Z as an explicit zero variance."""
    layer = _layer(2)
    mu_a = torch.randn(4, 3, generator=gen(3), dtype=F64)
    implicit = layer.forward(HiddenStates(mu_a, None))
    explicit = layer.forward(HiddenStates(mu_a, torch.zeros_like(mu_a)))
    torch.testing.assert_close(implicit.var_a, explicit.var_a, rtol=1e-14, atol=0)


def test_backward_matches_dense_formulas():
    """δ for the previous Z and Δm_W, Δv_W, Δm_B, Δv_B equal docs/tagi.md per element."""
    layer = _layer(4, 3, 2)
    g = gen(5)
    mu_a = torch.randn(5, 3, generator=g, dtype=F64)
    jcb = torch.rand(5, 3, generator=g, dtype=F64)
    layer.forward(HiddenStates(mu_a, torch.rand(5, 3, generator=g, dtype=F64), jcb))
    d_mu = torch.randn(5, 2, generator=g, dtype=F64)
    d_var = -torch.rand(5, 2, generator=g, dtype=F64)
    prev = layer.backward(DeltaStates(d_mu, d_var), need_input_delta=True)
    layer.scale_deltas_()
    m_w, v_w, v_b = layer.mu_w, layer.var_w, layer.var_b
    for b in range(5):
        for j in range(3):
            exp_mu = jcb[b, j] * sum(d_mu[b, i] * m_w[i, j] for i in range(2))
            exp_var = jcb[b, j] ** 2 * sum(d_var[b, i] * m_w[i, j] ** 2 for i in range(2))
            assert math.isclose(prev.delta_mu[b, j], exp_mu, rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(prev.delta_var[b, j], exp_var, rel_tol=1e-12, abs_tol=1e-15)
    for i in range(2):
        for j in range(3):
            dmw = v_w[i, j] * sum(d_mu[b, i] * mu_a[b, j] for b in range(5))
            dvw = v_w[i, j] ** 2 * sum(d_var[b, i] * mu_a[b, j] ** 2 for b in range(5))
            assert math.isclose(layer.delta_mu_w[i, j], dmw, rel_tol=1e-12)
            assert math.isclose(layer.delta_var_w[i, j], dvw, rel_tol=1e-12)
        assert math.isclose(layer.delta_mu_b[i], v_b[i] * d_mu[:, i].sum(), rel_tol=1e-12)
        assert math.isclose(layer.delta_var_b[i], v_b[i] ** 2 * d_var[:, i].sum(), rel_tol=1e-12)


@pytest.mark.parametrize("out_features", [1, 3])
def test_single_observation_is_the_exact_bayesian_posterior(out_features):
    """One Linear layer, B = 1, deterministic input, cap inactive: the updated moments are the
    diagonal of the exact Gaussian posterior of Bayesian linear regression."""
    manual_seed(7)
    net = Sequential(Linear(4, out_features), dtype=F64)
    layer = net.layers[0]
    g = gen(8)
    x = torch.randn(1, 4, generator=g, dtype=F64)
    y = torch.randn(1, out_features, generator=g, dtype=F64)
    var_obs = 0.3
    prior = {name: t.clone() for name, t in net.named_parameter_tensors()}
    regression_step(net, x, y, var_obs)
    h = torch.cat([x[0], torch.ones(1, dtype=F64)])  # y_i = h · [w_i, b_i] + ε
    for i in range(out_features):
        mean = torch.cat([prior["0.mu_w"][i], prior["0.mu_b"][i:i + 1]])
        cov = torch.diag(torch.cat([prior["0.var_w"][i], prior["0.var_b"][i:i + 1]]))
        gain = cov @ h / (h @ cov @ h + var_obs)
        post_mean = mean + gain * (y[0, i] - h @ mean)
        post_cov = cov - torch.outer(gain, h @ cov)
        torch.testing.assert_close(torch.cat([layer.mu_w[i], layer.mu_b[i:i + 1]]), post_mean,
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(torch.cat([layer.var_w[i], layer.var_b[i:i + 1]]),
                                   torch.diagonal(post_cov), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method,gain", [("He", 1.0), ("Xavier", 0.5)])
def test_init_follows_pytagi(method, gain):
    """m ~ N(0, s²) and v = (gain·s)² with s = sqrt(1/fan_in) (He) or sqrt(2/(in+out))."""
    manual_seed(0)
    layer = Linear(400, 300, gain_weight=gain, gain_bias=2 * gain, init_method=method)
    s = math.sqrt(1 / 400) if method == "He" else math.sqrt(2 / 700)
    assert layer.mu_w.std().item() == pytest.approx(s, rel=0.01)
    assert abs(layer.mu_w.mean().item()) < 4 * s / math.sqrt(400 * 300)
    torch.testing.assert_close(layer.var_w, torch.full((300, 400), (gain * s) ** 2))
    torch.testing.assert_close(layer.var_b, torch.full((300,), (2 * gain * s) ** 2))
    assert layer.mu_b.std().item() == pytest.approx(s, rel=0.15)


def test_no_bias():
    manual_seed(0)
    net = Sequential(Linear(3, 2, bias=False))
    assert [name for name, _ in net.named_parameter_tensors()] == ["0.mu_w", "0.var_w"]
    mu, _ = net(torch.zeros(1, 3))
    assert torch.equal(mu, torch.zeros(1, 2))
