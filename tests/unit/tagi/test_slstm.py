"""SLSTM, SLinear and the smoother against oracles (docs/tagi.md, SLSTM and the smoother): the
recorded covariances against the Jacobian of the LSTM cell, the backward pass against the exact
posterior of a linear-Gaussian series, series side by side against one at a time, nesting,
save/load and bad use."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (SLSTM, LayerBlock, Linear, OutputUpdater, Sequential, SLinear,
                          manual_seed)
from dptrain.tagi.slstm import SMOOTHER_EPS, _smooth
from dptrain.tagi.states import HiddenStates
from tests.unit.tagi.helpers import F64, gen

STATES = ("mu_h", "var_h", "mu_c", "var_c")


def _stack(dtype=F64, nested: bool = False) -> Sequential:
    manual_seed(0)
    first, second = SLSTM(2, 3, 1), SLSTM(3, 3, 1)
    layers = [LayerBlock(first, second)] if nested else [first, second]
    return Sequential(*layers, SLinear(3, 1), dtype=dtype)


def _series(batch: int, steps: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, batch, 2) inputs and (steps, batch, 1) targets of a noisy sine per series."""
    g = gen(seed)
    t = torch.arange(steps, dtype=F64)[:, None, None]
    phase = torch.rand(1, batch, 1, generator=g, dtype=F64) * 6
    x = torch.cat([torch.sin(0.5 * t + phase), torch.cos(0.5 * t + phase)], dim=2)
    y = torch.sin(0.5 * (t + 1) + phase) + 0.1 * torch.randn(steps, batch, 1, generator=g,
                                                               dtype=F64)
    return x, y


def _run(net: Sequential, x: torch.Tensor, y: torch.Tensor, step: bool = True) -> None:
    updater = OutputUpdater()
    for t in range(x.shape[0]):
        net(x[t].to(net.dtype))
        updater.update(net.output_z_buffer, y[t].to(net.dtype), 0.05, net.input_delta_z_buffer)
        net.backward()
        if step:
            net.step()


def test_recorded_covariances_are_the_linearised_cell():
    """Cov(H_{t−1}, H_t) = v_H{t−1} ∂H_t/∂H_{t−1} and Cov(C_{t−1}, C_t) = v_C{t−1} f, the
    derivatives of the deterministic LSTM cell at the means (autograd), checked with tiny
    carried variances, where the mean path is that cell."""
    manual_seed(2)
    layer = SLSTM(2, 3, 1, dtype=F64)
    g = gen(3)
    layer.mu_w.copy_(torch.randn(12, 5, generator=g, dtype=F64))
    layer.mu_b.copy_(torch.randn(12, generator=g, dtype=F64))
    x = torch.randn(1, 2, generator=g, dtype=F64)
    h_prev, c_prev = torch.randn(1, 1, 3, generator=g, dtype=F64), torch.randn(1, 1, 3,
                                                                               generator=g,
                                                                               dtype=F64)
    tiny = torch.full((1, 1, 3), 1e-12, dtype=F64)
    layer.forward(HiddenStates(x, None))  # sets the batch of the carry
    layer.mu_h_prior, layer.var_h_prior, layer.mu_c_prior, layer.var_c_prior = \
        h_prev, tiny, c_prev, tiny
    layer.forward(HiddenStates(x, None))
    step = layer._pending

    def cell(h, c):
        z = torch.cat([x[0], h]) @ layer.mu_w.t() + layer.mu_b
        f, i, cc, o = torch.sigmoid(z[:3]), torch.sigmoid(z[3:6]), torch.tanh(z[6:9]), \
            torch.sigmoid(z[9:])
        c_new = f * c + i * cc
        return o * torch.tanh(c_new), c_new

    d_h = torch.autograd.functional.jacobian(lambda h: cell(h, c_prev[0, 0])[0], h_prev[0, 0])
    f_gate = torch.sigmoid(torch.cat([x[0], h_prev[0, 0]]) @ layer.mu_w[:3].t() + layer.mu_b[:3])
    torch.testing.assert_close(step.cov_hh[0] / 1e-12, d_h.t(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(step.cov_cc[0] / 1e-12, f_gate, rtol=1e-6, atol=1e-9)
    h_new, c_new = cell(h_prev[0, 0], c_prev[0, 0])
    torch.testing.assert_close(step.mu_h_prior[0], h_new, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(step.mu_c_prior[0], c_new, rtol=1e-9, atol=1e-12)


def _kalman(a: torch.Tensor, q: float, r: float, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Filter of X_t = a X_{t−1} + N(0, q), Y_t = X_t + N(0, r), X_{−1} = 0, per unit
    (a: (O,), y: (T, O)), in the smoother's record format (B = 1)."""
    m, p = torch.zeros_like(a), torch.zeros_like(a)
    rec: dict[str, list] = {k: [] for k in ("mu_prior", "var_prior", "mu_post", "var_post",
                                            "cov")}
    for y_t in y:
        cov = a * p  # Cov(X_{t−1} | y_{<t}, X_t)
        m, p = a * m, a * a * p + q
        rec["mu_prior"].append(m), rec["var_prior"].append(p), rec["cov"].append(cov)
        gain = p / (p + r)
        m, p = m + gain * (y_t - m), p - gain * p
        rec["mu_post"].append(m), rec["var_post"].append(p)
    return {k: torch.stack(v)[:, None] for k, v in rec.items()}  # (T, 1, O)


def _exact_posterior(a: torch.Tensor, q: float, r: float, y: torch.Tensor):
    """Marginal means and variances of X_t given every Y, by conditioning the joint Gaussian."""
    steps = y.shape[0]
    means, variances = [], []
    for unit in range(a.shape[0]):
        # X = L w with X_t = Σ_{s ≤ t} a^{t−s} w_s, w ~ N(0, q)
        idx = torch.arange(steps, dtype=F64)
        lower = torch.tril(a[unit] ** (idx[:, None] - idx[None, :]))
        sxx = q * lower @ lower.t()
        gain = sxx @ torch.linalg.inv(sxx + r * torch.eye(steps, dtype=F64))
        means.append(gain @ y[:, unit])
        variances.append(torch.diagonal(sxx - gain @ sxx))
    return torch.stack(means, 1), torch.stack(variances, 1)


@pytest.mark.parametrize("kind", ["c", "h"])
def test_backward_pass_is_the_exact_smoother_of_a_linear_gaussian_series(kind):
    """Fed a Kalman filter's priors, posteriors and Cov(X_{t−1}, X_t) of independent AR(1)
    units, the pass gives the exact posterior marginals given the whole series (cell states:
    a gain per unit; hidden states: the (O, O) gain matrix, here diagonal)."""
    a, q, r = torch.tensor([0.9, -0.5, 1.0], dtype=F64), 0.3, 0.2
    y = torch.randn(7, 3, generator=gen(4), dtype=F64)
    rec = _kalman(a, q, r, y)
    cov = rec["cov"] if kind == "c" else torch.diag_embed(rec["cov"])
    steps = {f"mu_{kind}_prior": rec["mu_prior"], f"var_{kind}_prior": rec["var_prior"],
             f"mu_{kind}_post": rec["mu_post"], f"var_{kind}_post": rec["var_post"],
             f"cov_{kind}{kind}": cov}
    apply = (lambda gain, d: gain * d) if kind == "c" else \
        (lambda gain, d: torch.einsum("bkj,bj->bk", gain, d))
    mu, var, clipped = _smooth(steps, kind, apply)
    assert clipped.item() == 0
    want_mu, want_var = _exact_posterior(a, q, r, y)
    torch.testing.assert_close(mu[:, 0], want_mu, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(var[:, 0], want_var, rtol=1e-10, atol=1e-12)


def test_backward_pass_guards_as_pytagi_does():
    """A prior variance ≤ 0 in a gain's denominator counts as 1e-5, and a smoothed variance
    that comes out negative is set to 1e-5 and counted."""
    def series(first: float, second: float) -> torch.Tensor:  # (T=2, B=1, O=1)
        return torch.tensor([first, second], dtype=F64).view(2, 1, 1)

    steps = {"mu_c_prior": series(0, 0), "var_c_prior": series(1, 0),
             "mu_c_post": series(0, 2), "var_c_post": series(0.5, 0.5),
             "cov_cc": series(0, 1e-6)}
    mu, var, _ = _smooth(steps, "c", lambda gain, d: gain * d)
    gain = 1e-6 / SMOOTHER_EPS  # = 0.1, from the guarded denominator
    assert mu[0].item() == pytest.approx(0.0 + gain * 2.0, rel=1e-12)
    assert var[0].item() == pytest.approx(0.5 + gain**2 * 0.5, rel=1e-12)
    steps.update(var_c_post=series(0.5, 0), var_c_prior=series(1, 100), cov_cc=series(0, 50))
    _, var, clipped = _smooth(steps, "c", lambda gain, d: gain * d)  # 0.5 + 0.25·(−100) < 0
    assert var[0].item() == SMOOTHER_EPS and clipped.item() == 1


def test_series_side_by_side_equal_one_at_a_time():
    """Sample b of every call continues series b: a batch of 2 series (deltas computed, no
    step, so the parameters stay shared) carries and smooths each exactly as alone."""
    x, y = _series(2, 6)
    together = _stack()
    _run(together, x, y, step=False)
    mu, var = together.smoother()
    assert mu.shape == (6, 2, 1)
    for b in range(2):
        alone = _stack()
        _run(alone, x[:, b:b + 1], y[:, b:b + 1], step=False)
        mu_b, var_b = alone.smoother()
        torch.testing.assert_close(mu[:, b:b + 1], mu_b, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(var[:, b:b + 1], var_b, rtol=1e-12, atol=1e-14)
        for i in range(2):
            for name in STATES:
                torch.testing.assert_close(getattr(together.layers[i], f"{name}_smooths")[:, b],
                                           getattr(alone.layers[i], f"{name}_smooths")[:, 0],
                                           rtol=1e-12, atol=1e-14)


def test_smoothing_is_at_least_as_sure_as_filtering_and_ends_on_the_filter():
    """Smoothed variances of H and C never exceed the filtered (posterior) ones, since each
    backward correction adds G² (v_s − v_prior) ≤ 0; the last step's smoothed states are its
    posteriors; the carried states are zeroed for the next pass."""
    net = _stack()
    x, y = _series(1, 10)
    posts = {name: [] for name in STATES}
    updater = OutputUpdater()
    for t in range(10):
        net(x[t])
        updater.update(net.output_z_buffer, y[t], 0.05, net.input_delta_z_buffer)
        net.backward()
        net.step()
        for name in STATES:
            posts[name].append(getattr(net.layers[1], f"{name}_prior")[:, 0].clone())
    net.smoother()
    layer = net.layers[1]
    for name in STATES:
        assert torch.equal(getattr(layer, f"{name}_smooths")[-1], posts[name][-1])
    for name in ("var_h", "var_c"):
        smoothed, filtered = getattr(layer, f"{name}_smooths"), torch.stack(posts[name])
        assert bool((smoothed <= filtered).all()) and bool((smoothed < filtered).any()), name
    assert net.layers[0].mu_h_prior is None and net.layers[0].num_recorded_steps == 0


def test_float32_tracks_float64_nested_blocks_and_save_load(tmp_path):
    """One network in float32 and float64, flat and with its SLSTMs in a LayerBlock (same
    numbers, keys one level deeper); save/load round-trips the parameters."""
    x, y = _series(1, 6)
    flat, nested, single = _stack(), _stack(nested=True), _stack(torch.float32)
    for net in (flat, nested, single):
        _run(net, x, y)
    assert torch.equal(nested.flat_params, flat.flat_params)
    assert "0.1.mu_w" in nested.state_dict() and "1.mu_w" in flat.state_dict()
    torch.testing.assert_close(single.flat_params.double(), flat.flat_params, rtol=1e-5,
                               atol=1e-6)
    for a, b in zip(flat.smoother(), nested.smoother()):
        assert torch.equal(a, b)
    flat.save(tmp_path / "slstm.pt")
    fresh = _stack()
    fresh.load(tmp_path / "slstm.pt")
    assert torch.equal(fresh.flat_params, flat.flat_params)


def test_slinear_smoother_is_the_linear_forward_of_every_output():
    """docs/tagi.md, Departures from pytagi: with several outputs each smoothed step is the
    Linear forward moments of the smoothed hidden state, every output (pytagi's indices only
    hold for one)."""
    manual_seed(5)
    head = SLinear(3, 2, dtype=F64)
    g = gen(6)
    mu_h, var_h = torch.randn(4, 2, 3, generator=g, dtype=F64), torch.rand(4, 2, 3, generator=g,
                                                                             dtype=F64)
    mu, var = head.smoother(mu_h, var_h)
    assert mu.shape == (4, 2, 2)
    for t in range(4):
        step = Linear.forward(head.eval(), HiddenStates(mu_h[t], var_h[t]))
        torch.testing.assert_close(mu[t], step.mu_a, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(var[t], step.var_a, rtol=1e-14, atol=1e-15)


def test_bad_use_is_named():
    with pytest.raises(ValueError, match="SLSTM: seq_len must be 1 .* got 4"):
        SLSTM(2, 3, 4)
    net = _stack()
    with pytest.raises(RuntimeError, match=r"layer 0 \(SLSTM\(2, 3.*needs recorded training "
                                           r"steps"):
        net.smoother()
    x, y = _series(2, 3)
    _run(net, x[:2], y[:2])
    with pytest.raises(ValueError, match=r"2 steps of 2 series recorded, then a batch of 1"):
        net(x[2, :1])
    manual_seed(0)
    with pytest.raises(ValueError, match=r"SLinear\(3, 1.*needs an SLSTM before"):
        Sequential(SLinear(3, 1)).smoother()
