"""Heteroscedastic regression: EvenExp, the AGVI update (OutputUpdater.update_heteros) and the
split of a prediction into mean, epistemic and aleatoric variance."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.tagi import (EvenExp, Linear, OutputUpdater, ReLU, Sequential, manual_seed,
                          split_heteros)
from dptrain.tagi.states import DeltaStates, HiddenStates
from tests.unit.tagi.helpers import F64, assert_close_mc, gen, monte_carlo

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "pytagi_fixtures.npz"


def test_evenexp_moments_and_jacobian_match_monte_carlo():
    mu_z = torch.tensor([[0.3, -0.7, 1.1, 0.2]], dtype=F64)
    var_z = torch.tensor([[0.5, 0.4, 0.2, 0.9]], dtype=F64)
    mu_a, var_a, jcb = EvenExp().moments(mu_z, var_z)
    z = mu_z + var_z.sqrt() * torch.randn((400_000, 4), generator=gen(1), dtype=F64)
    mc = monte_carlo(torch.exp(z[:, 1::2]), z[:, 1::2])
    assert_close_mc(mu_a[0, 1::2], mc.mean, mc.mean_se, "mean of exp(Z)")
    assert_close_mc(var_a[0, 1::2], mc.var, mc.var_se, "variance of exp(Z)")
    assert_close_mc(jcb[0, 1::2], mc.jcb, mc.jcb_se, "J = Cov(exp Z, Z)/v_Z")
    # even slots pass through untouched with J = 1
    assert torch.equal(mu_a[0, 0::2], mu_z[0, 0::2]) and torch.equal(var_a[0, 0::2], var_z[0, 0::2])
    assert torch.equal(jcb[0, 0::2], torch.ones(2, dtype=F64))


def test_evenexp_needs_pairs():
    with pytest.raises(ValueError, match=r"EvenExp needs \(batch, 2 x targets\).*\(4, 3\)"):
        EvenExp().moments(torch.zeros(4, 3), torch.ones(4, 3))


def _update(mu_y, var_y, mu_t, var_t, y):
    """update_heteros on one target with J = 1: the innovations of (Y, T) themselves."""
    states = HiddenStates(torch.tensor([[mu_y, mu_t]], dtype=F64),
                          torch.tensor([[var_y, var_t]], dtype=F64))
    delta = DeltaStates()
    OutputUpdater().update_heteros(states, torch.tensor([y], dtype=F64), delta)
    return delta.delta_mu[0], delta.delta_var[0]


def test_single_observation_equals_closed_form():
    m_y, v_y, m_t, v_t, y = 0.4, 0.3, 0.5, 0.02, 1.3
    (dm_y, dm_t), (dv_y, dv_t) = _update(m_y, v_y, m_t, v_t, y)
    s = v_y + m_t
    assert dm_y.item() == pytest.approx((y - m_y) / s, rel=1e-14)
    assert dv_y.item() == pytest.approx(-1 / s, rel=1e-14)
    # V | y for y = Y + V, V ~ N(0, m_t): Gaussian; then the moments of V² under it
    m_v, v_v = m_t * (y - m_y) / s, m_t * v_y / s
    m_v2, v_v2 = m_v**2 + v_v, 2 * v_v**2 + 4 * v_v * m_v**2
    k = v_t / (3 * v_t + 2 * m_t**2)
    post_m_t = m_t + k * (m_v2 - m_t)
    post_v_t = v_t + k**2 * (v_v2 - (3 * v_t + 2 * m_t**2))
    assert m_t + v_t * dm_t.item() == pytest.approx(post_m_t, rel=1e-13)
    assert v_t + v_t**2 * dv_t.item() == pytest.approx(post_v_t, rel=1e-13)


def test_agvi_moments_match_sampling():
    """Each Gaussian quantity the update is built from, estimated by sampling the model
    y = Y + V, V = sqrt(T) ε, T log-normal: the prior moments of V², Cov(T, V²), and V | y."""
    m_y, v_y, m_t, v_t = 0.4, 0.3, 0.5, 0.02
    n = 2_000_000
    g = gen(3)
    v_ln = math.log1p(v_t / m_t**2)
    t = torch.exp(math.log(m_t) - v_ln / 2 + math.sqrt(v_ln) * torch.randn(n, generator=g,
                                                                            dtype=F64))
    v2 = t * torch.randn(n, generator=g, dtype=F64) ** 2
    mc = monte_carlo(v2, t)  # J here is Cov(V², T)/v_T
    assert_close_mc(torch.tensor(m_t, dtype=F64), mc.mean, mc.mean_se, "E[V²] = m_T")
    assert_close_mc(torch.tensor(3 * v_t + 2 * m_t**2, dtype=F64), mc.var, mc.var_se,
                    "Var(V²) = 3 v_T + 2 m_T²")
    assert_close_mc(torch.tensor(1.0, dtype=F64), mc.jcb, mc.jcb_se, "Cov(V², T) = v_T")
    # V | y with V ~ N(0, m_T) and Y ~ N(m_Y, v_Y): the linear regression of V on y
    big_y = m_y + math.sqrt(v_y) * torch.randn(n, generator=g, dtype=F64)
    noise = math.sqrt(m_t) * torch.randn(n, generator=g, dtype=F64)
    obs = big_y + noise
    slope = torch.cov(torch.stack([noise, obs]))[0, 1] / obs.var()
    s = v_y + m_t
    assert slope.item() == pytest.approx(m_t / s, abs=5e-3)
    # ... and Var(V | y) = m_T − m_T²/s, the residual variance of that regression
    residual_var = (noise - slope * obs).var().item()
    assert residual_var == pytest.approx(m_t - m_t**2 / s, rel=5e-3)


def _net(seed: int = 0) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(2, 8), ReLU(), Linear(8, 4), EvenExp(), dtype=F64)


def _train_step(net: Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
    net(x)
    OutputUpdater().update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)
    net.backward()


def test_nan_targets_leave_parameters_untouched():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(5, 2, generator=gen(0), dtype=F64)
    _train_step(net, x, torch.full((5, 2), float("nan"), dtype=F64))
    net.step()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_nan_target_contributes_nothing_to_the_deltas():
    x = torch.randn(6, 2, generator=gen(1), dtype=F64)
    y = torch.randn(6, 2, generator=gen(2), dtype=F64)
    y_missing = y.clone()
    y_missing[2, 1] = y_missing[4, :] = float("nan")
    net_a, net_b = _net(), _net()
    _train_step(net_a, x, y_missing)
    # the same deltas as the batch whose missing targets are simply not observed:
    # sample 4 dropped, and sample 2's second target observed exactly at zero innovation
    keep = [0, 1, 2, 3, 5]
    net_b(x[keep])
    OutputUpdater().update_heteros(net_b.output_z_buffer, y[keep], net_b.input_delta_z_buffer)
    net_b.input_delta_z_buffer.delta_mu[2, 2:] = 0
    net_b.input_delta_z_buffer.delta_var[2, 2:] = 0
    net_b.backward()
    for (name, a), (_, b) in zip(net_a.named_delta_tensors(), net_b.named_delta_tensors()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=name)


def test_deltas_add_over_batch_splits():
    x = torch.randn(8, 2, generator=gen(4), dtype=F64)
    y = torch.randn(8, 2, generator=gen(5), dtype=F64)
    whole, parts = _net(), [_net(), _net()]
    _train_step(whole, x, y)
    _train_step(parts[0], x[:3], y[:3])
    _train_step(parts[1], x[3:], y[3:])
    for (name, w), (_, a), (_, b) in zip(whole.named_delta_tensors(),
                                         parts[0].named_delta_tensors(),
                                         parts[1].named_delta_tensors()):
        torch.testing.assert_close(w, a + b, rtol=1e-12, atol=1e-15, msg=name)


def test_split_heteros_reports_in_data_units():
    mu = torch.tensor([[1.0, 0.25], [-2.0, 0.5]], dtype=F64)
    var = torch.tensor([[0.1, 0.01], [0.2, 0.02]], dtype=F64)
    pred = split_heteros(mu, var, y_mean=10.0, y_scale=3.0)
    torch.testing.assert_close(pred.mean, torch.tensor([[13.0], [4.0]], dtype=F64))
    torch.testing.assert_close(pred.epistemic_var, torch.tensor([[0.9], [1.8]], dtype=F64))
    torch.testing.assert_close(pred.aleatoric_var, torch.tensor([[2.25], [4.5]], dtype=F64))
    torch.testing.assert_close(pred.total_var, pred.epistemic_var + pred.aleatoric_var)


class _WheelEvenExp(EvenExp):
    """EvenExp with the pytagi 0.2.1 wheel's noise-slot Jacobian J = v_Z m_T, written from the
    pre-activation moments (m_T = exp(m_Z + v_Z/2)) rather than from the shipped J, so that a
    wrong shipped J cannot carry over into this reference."""

    def moments(self, mu_z, var_z):
        mu_a, var_a, jcb = super().moments(mu_z, var_z)
        jcb = torch.ones_like(jcb)
        jcb[:, 1::2] = var_z[:, 1::2] * torch.exp(mu_z[:, 1::2] + 0.5 * var_z[:, 1::2])
        return mu_a, var_a, jcb


def _fixture_net(fx, evenexp) -> Sequential:
    net = Sequential(Linear(2, 8), ReLU(), Linear(8, 2), evenexp, dtype=F64)
    state = net.state_dict()
    net.load_state_dict({k: torch.from_numpy(fx[f"fnn_heteros/init/{k}"]).view_as(v)
                         for k, v in state.items()})
    return net


def _run_fixture_steps(net: Sequential, fx) -> list[tuple[str, torch.Tensor, np.ndarray]]:
    """(what, ours, pytagi's) for the two recorded steps and the eval forward."""
    pairs = []
    for k in range(2):
        mu, var = net(torch.from_numpy(fx[f"fnn_heteros/x{k}"]))
        pairs += [(f"step{k} out_mu", mu, fx[f"fnn_heteros/step{k}/out_mu"]),
                  (f"step{k} out_var", var, fx[f"fnn_heteros/step{k}/out_var"])]
        OutputUpdater().update_heteros(net.output_z_buffer,
                                       torch.from_numpy(fx[f"fnn_heteros/y{k}"]),
                                       net.input_delta_z_buffer)
        net.backward()
        deltas = dict(net.named_delta_tensors())
        for name, ours in deltas.items():
            pairs.append((f"step{k} {name}", ours.clone(), fx[f"fnn_heteros/step{k}/{name}"]))
        net.step()
        for name, ours in net.state_dict().items():
            pairs.append((f"step{k} after {name}", ours.clone(), fx[f"fnn_heteros/step{k}/after/{name}"]))
    net.eval()
    mu, var = net(torch.from_numpy(fx["fnn_heteros/x_eval"]))
    return pairs + [("eval out_mu", mu, fx["fnn_heteros/eval/out_mu"]),
                    ("eval out_var", var, fx["fnn_heteros/eval/out_var"])]


def _worst_relative(pairs) -> tuple[float, str]:
    worst, where = 0.0, ""
    for what, ours, theirs in pairs:
        ours = ours.detach().reshape(-1).numpy()
        scale = max(float(np.abs(theirs).max()), 1e-6)
        err = float(np.abs(ours - theirs).max()) / scale
        if err > worst:
            worst, where = err, what
    return worst, where


@pytest.mark.recorded
def test_parity_with_pytagi_is_exact_up_to_the_wheels_evenexp_jacobian():
    """The 0.2.1 wheel uses J = v_Z m_T in EvenExp; with that one change we reproduce its two
    recorded steps (forward, every delta, parameters) to 5e-7 relative to each array's scale,
    the figure the docs quote (measured 4.3e-7, the wheel's float32 rounding)."""
    with np.load(FIXTURES) as fx:
        fx = dict(fx)
    worst, where = _worst_relative(_run_fixture_steps(_fixture_net(fx, _WheelEvenExp()), fx))
    assert worst < 5e-7, f"wheel Jacobian: {where} differs by {worst:.2e} (relative)"


@pytest.mark.recorded
def test_shipped_jacobian_is_the_wheels_step_with_the_noise_innovations_divided_by_v_z():
    """The other half of the parity: the shipped EvenExp (J = m_T) differs from the wheel's
    (J = v_Z m_T, reproduced above) by exactly that J. The AGVI innovations of the noise slot
    are proportional to J_T (δm) and J_T² (δv), so on the recorded first step ours are the
    wheel's divided by v_Z and v_Z² of the noise pre-activation, the mean slot unchanged, and
    every parameter delta is what the wheel network's backward makes of those innovations (to
    1e-12). Mutations tried, each failing this test: shipping the wheel's J = v_Z m_T, J = m_T²,
    and J_T/v_T instead of (J_T/v_T)² in the noise slot's δv (`_agvi_innovations`)."""
    with np.load(FIXTURES) as fx:
        fx = dict(fx)
    x, y = torch.from_numpy(fx["fnn_heteros/x0"]), torch.from_numpy(fx["fnn_heteros/y0"])
    ours, wheel = _fixture_net(fx, EvenExp()), _fixture_net(fx, _WheelEvenExp())
    for net in (ours, wheel):
        net(x)
        OutputUpdater().update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)
    torch.testing.assert_close(ours.output_z_buffer.mu_a, wheel.output_z_buffer.mu_a,
                               rtol=0, atol=0)  # the same forward: only J differs
    # v_Z of the noise slot from its log-normal output: v_T = m_T² (exp(v_Z) − 1).
    out = wheel.output_z_buffer
    var_z = torch.log1p(out.var_a[:, 1::2] / out.mu_a[:, 1::2] ** 2)
    assert float((var_z - 1).abs().min()) > 1e-2  # v_Z ≠ 1 in every sample: the J differ
    got, expect = ours.input_delta_z_buffer, wheel.input_delta_z_buffer
    expect.delta_mu[:, 1::2] /= var_z
    expect.delta_var[:, 1::2] /= var_z**2
    torch.testing.assert_close(got.delta_mu, expect.delta_mu, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got.delta_var, expect.delta_var, rtol=1e-12, atol=1e-15)
    ours.backward()
    wheel.backward()  # from the innovations scaled in place above
    for (name, mine), (_, theirs) in zip(ours.named_delta_tensors(),
                                         wheel.named_delta_tensors()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-15, msg=name)
