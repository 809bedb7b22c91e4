"""Activations: Monte-Carlo moments and J = Cov(A, Z)/v_Z (docs/tagi.md, Activations).

Mixture* layers are exact for any Gaussian input, so they are checked on a grid of wide inputs.
Linearised layers are exact only to first order: they are checked against Monte Carlo with a
small input variance (where the linearisation error is far below the tolerance) and against
autograd derivatives of their nonlinearity.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dptrain.tagi import (HiddenStates, LeakyReLU, MixtureReLU, MixtureSigmoid, MixtureTanh, ReLU,
                          Sigmoid, Softplus, Tanh)
from tests.unit.tagi.helpers import F64, assert_close_mc, gen, monte_carlo

N_SAMPLES = 200_000
MIXTURE_CASES = {  # (layer, the function it moment-matches)
    "MixtureReLU": (MixtureReLU, torch.relu),
    "MixtureTanh": (MixtureTanh, lambda z: z.clamp(-1.0, 1.0)),
    "MixtureSigmoid": (MixtureSigmoid, lambda z: (z.clamp(-1.0, 1.0) + 1.0) / 2.0),
}
LINEARISED_CASES = {
    "ReLU": (ReLU, torch.relu),
    "LeakyReLU": (LeakyReLU, lambda z: F.leaky_relu(z, 0.1)),
    "Sigmoid": (Sigmoid, torch.sigmoid),
    "Tanh": (Tanh, torch.tanh),
    "Softplus": (Softplus, F.softplus),
}


def _grid(means: list[float], variances: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    mu = torch.tensor(means, dtype=F64).repeat_interleave(len(variances))
    var = torch.tensor(variances, dtype=F64).repeat(len(means))
    return mu[None, :], var[None, :]  # (1, G): one "sample" of G units


def _check_against_monte_carlo(layer, fn, mu_z, var_z, seed):
    out = layer.forward(HiddenStates(mu_z, var_z))
    z = mu_z + var_z.sqrt() * torch.randn(N_SAMPLES, *mu_z.shape, generator=gen(seed), dtype=F64)
    mc = monte_carlo(fn(z), z)
    name = type(layer).__name__
    assert_close_mc(out.mu_a, mc.mean, mc.mean_se, f"{name} mean", atol=2e-5)
    assert_close_mc(out.var_a, mc.var, mc.var_se, f"{name} variance", atol=2e-5)
    assert_close_mc(out.jcb, mc.jcb, mc.jcb_se, f"{name} J", atol=2e-5)
    return out


@pytest.mark.parametrize("name", sorted(MIXTURE_CASES))
def test_mixture_moments_are_exact(name):
    """Exact mean, variance and Cov(A,Z)/v_Z of the clipped / rectified Gaussian (docs/tagi.md)."""
    layer_cls, fn = MIXTURE_CASES[name]
    mu_z, var_z = _grid([-2.0, -0.7, 0.0, 0.4, 1.3, 2.5], [0.05, 0.5, 2.0])
    out = _check_against_monte_carlo(layer_cls(), fn, mu_z, var_z, seed=11)
    assert bool((out.var_a >= 1e-6).all())


@pytest.mark.parametrize("name", sorted(LINEARISED_CASES))
def test_linearised_moments_match_monte_carlo_for_small_variance(name):
    """With v_Z = 1e-4 the first-order moments are within Monte-Carlo noise of the truth."""
    layer_cls, fn = LINEARISED_CASES[name]
    mu_z, var_z = _grid([-1.5, -0.4, 0.3, 1.1, 2.0], [1e-4])
    _check_against_monte_carlo(layer_cls(), fn, mu_z, var_z, seed=12)


@pytest.mark.parametrize("name", sorted(LINEARISED_CASES))
def test_linearised_moments_are_f_and_its_derivative(name):
    """m_A = f(m_Z), J = f'(m_Z) (autograd), v_A = J² v_Z, for any input variance."""
    layer_cls, fn = LINEARISED_CASES[name]
    mu_z = torch.linspace(-3, 3, 13, dtype=F64)[None, :] + 0.01  # avoid ReLU's kink at 0
    var_z = torch.rand(1, 13, generator=gen(13), dtype=F64) * 3
    out = layer_cls().forward(HiddenStates(mu_z, var_z))
    z = mu_z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(z).sum(), z)
    torch.testing.assert_close(out.mu_a, fn(mu_z), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.jcb, grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.var_a, grad**2 * var_z, rtol=1e-12, atol=1e-14)


def _cutagi_relu(m, v):
    """docs/tagi.md, Activations: MixtureReLU, literally (unfloored)."""
    s = v.sqrt()
    a = m / s
    cdf, pdf = torch.special.ndtr(a), torch.exp(-a * a / 2) / (2 * torch.pi) ** 0.5
    mt = m * cdf + s * pdf
    return mt, -mt * mt + 2 * mt * m - m * s * pdf + (v - m * m) * cdf, cdf


def _cutagi_hard_tanh(m, v):
    """docs/tagi.md, Activations: MixtureTanh, literally (unfloored)."""
    s = v.sqrt()
    a_l, a_u = (1 + m) / s, (1 - m) / s
    p_l, p_u = torch.special.ndtr(a_l), torch.special.ndtr(a_u)
    d_l, d_u = (torch.exp(-x * x / 2) / (2 * torch.pi) ** 0.5 for x in (a_l, a_u))
    mt = (m + 1) * p_l + (m - 1) * p_u + s * (d_l - d_u) - m
    vt = (p_l * (v - m * m - 2 * m - 1) + p_u * (v - m * m + 2 * m - 1)
          + s * (d_u * (m - 1) - d_l * (m + 1)) - mt * mt + 2 * mt * m + m * m - v + 2)
    return mt, vt, p_l + p_u - 1


@pytest.mark.parametrize("layer_cls,reference", [(MixtureReLU, _cutagi_relu),
                                                 (MixtureTanh, _cutagi_hard_tanh)])
def test_stable_forms_equal_cutagi_formulas_in_float64(layer_cls, reference):
    """Our cancellation-free rewrites are the same functions as cuTAGI's expressions."""
    mu_z, var_z = _grid([-6.0, -1.5, -0.3, 0.0, 0.8, 2.0, 7.0], [1e-3, 0.1, 1.0, 9.0])
    out = layer_cls().forward(HiddenStates(mu_z, var_z))
    m_ref, v_ref, j_ref = reference(mu_z, var_z)
    torch.testing.assert_close(out.mu_a, m_ref.clamp_min(1e-6) if layer_cls is MixtureReLU
                               else m_ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out.var_a, v_ref.clamp_min(1e-6), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.jcb, j_ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("layer_cls", [MixtureReLU, MixtureTanh, MixtureSigmoid])
def test_mixture_float32_tracks_float64(layer_cls):
    """Absolute variance error ≤ 2e-6 in float32 over a wide grid; cuTAGI's literal form is
    off by up to 2e-5 for MixtureTanh and returns v = 2 instead of 0 at m = 1e5."""
    mu_z, var_z = _grid([-1e5, -8.0, -3.0, -1.1, -0.5, 0.0, 0.7, 1.2, 4.0, 9.0, 1e5],
                        [0.0, 1e-4, 1e-2, 0.3, 1.0, 10.0])
    out64 = layer_cls().forward(HiddenStates(mu_z, var_z))
    out32 = layer_cls().forward(HiddenStates(mu_z.float(), var_z.float()))
    for got, want in zip((out32.mu_a, out32.var_a, out32.jcb),
                         (out64.mu_a, out64.var_a, out64.jcb)):
        assert bool(torch.isfinite(got).all())
        err = (got.double() - want).abs()
        assert err.max().item() <= 2e-6 + 1e-6 * want.abs().max().item()


def test_mixture_relu_variance_survives_float32_when_mean_dominates():
    """m ≫ s: the rectified variance is ≈ v_Z; the naive E[R²] − μ̃² form loses it in float32."""
    mu_z = torch.tensor([[10.0, 30.0]], dtype=torch.float32)
    var_z = torch.tensor([[1e-3, 1e-2]], dtype=torch.float32)
    out = MixtureReLU().forward(HiddenStates(mu_z, var_z))
    torch.testing.assert_close(out.var_a, var_z, rtol=1e-5, atol=0)


def test_mixture_floors():
    """Far-negative inputs: mean and variance floored at 1e-6 as in cuTAGI (docs/tagi.md)."""
    out = MixtureReLU().forward(HiddenStates(torch.tensor([[-50.0]]), torch.tensor([[1.0]])))
    assert out.mu_a.item() == pytest.approx(1e-6)
    assert out.var_a.item() == pytest.approx(1e-6)
    assert out.jcb.item() == 0.0


def test_consecutive_activations_compose_their_jacobians():
    """Fix of cuTAGI (docs/tagi.md): J of Tanh after Sigmoid is J_tanh · J_sigmoid."""
    mu_z = torch.tensor([[0.3, -1.0]], dtype=F64)
    var_z = torch.tensor([[0.01, 0.02]], dtype=F64)
    first = Sigmoid().forward(HiddenStates(mu_z, var_z))
    second = Tanh().forward(first)
    alone = Tanh().forward(HiddenStates(first.mu_a, first.var_a))
    torch.testing.assert_close(second.jcb, alone.jcb * first.jcb)


def test_activation_on_deterministic_input_and_nchw_states():
    """var None (network input) means zero variance; image-shaped states work elementwise."""
    mu = torch.randn(2, 3, 4, 4, generator=gen(14), dtype=F64)
    out = MixtureTanh().forward(HiddenStates(mu, None))
    assert out.mu_a.shape == (2, 3, 4, 4)
    torch.testing.assert_close(out.mu_a, mu.clamp(-1, 1))
    out = ReLU().forward(HiddenStates(mu, None))
    assert torch.equal(out.var_a, torch.zeros_like(mu))
