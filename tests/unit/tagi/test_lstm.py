"""LSTM layer against oracles that share no code with it (docs/tagi.md, LSTM): Monte-Carlo
forward moments, autograd Jacobians of a plain deterministic LSTM cell for every innovation
and parameter delta, and pytagi's state-carrying rules; plus shapes, blocks, save/load, dtypes."""

from __future__ import annotations

import pytest
import torch

from dptrain.errors import CheckpointError
from dptrain.tagi import (LSTM, HiddenStates, LayerBlock, Linear, OutputUpdater, Sequential,
                          Tanh, manual_seed)
from dptrain.tagi.states import DeltaStates
from tests.unit.tagi.helpers import F64, assert_close_mc, gen, monte_carlo, regression_step


def _layer(seed: int, i: int = 2, o: int = 3, t: int = 3, var_w: float = 1e-5,
           bias: bool = True) -> LSTM:
    manual_seed(seed)
    layer = LSTM(i, o, t, bias=bias, dtype=F64)
    g = gen(seed + 100)
    layer.mu_w.copy_(torch.randn(layer.mu_w.shape, generator=g, dtype=F64))
    layer.var_w.copy_(var_w * (0.5 + torch.rand(layer.var_w.shape, generator=g, dtype=F64)))
    if bias:
        layer.mu_b.copy_(0.5 * torch.randn(layer.mu_b.shape, generator=g, dtype=F64))
        layer.var_b.copy_(var_w * (0.5 + torch.rand(layer.mu_b.shape, generator=g, dtype=F64)))
    return layer


def _cell(w, b, x, h_prev, c_prev):
    """A plain deterministic LSTM step on (B, T, ·) tensors, gates f, i, c, o stacked in w."""
    o = h_prev.shape[-1]
    z = torch.cat((x, h_prev), -1) @ w.T + (0 if b is None else b)
    f, i, c, out = z.split(o, -1)
    cell = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(c)
    return torch.sigmoid(out) * torch.tanh(cell), cell


def test_forward_moments_match_monte_carlo():
    """With small variances (linearisation error far below the noise) the gates, cell and
    hidden moments equal the sample moments of a deterministic LSTM run on sampled weights,
    biases and inputs, the Cov(i, c~) and Cov(o, tanh c) terms included: dropping either moves
    v_C or v_H by more than 15 standard errors."""
    layer = _layer(0)
    g = gen(1)
    mu_x = torch.randn(2, 3, 2, generator=g, dtype=F64)  # (B, T, I)
    var_x = 2e-5 * (0.5 + torch.rand(2, 3, 2, generator=g, dtype=F64))
    out = layer.forward(HiddenStates(mu_x, var_x))
    n = 150_000
    x = mu_x + var_x.sqrt() * torch.randn(n, 2, 3, 2, generator=g, dtype=F64)
    w = layer.mu_w + layer.var_w.sqrt() * torch.randn(n, *layer.mu_w.shape, generator=g,
                                                      dtype=F64)
    b = layer.mu_b + layer.var_b.sqrt() * torch.randn(n, *layer.mu_b.shape, generator=g,
                                                      dtype=F64)
    zeros = torch.zeros(n, 2, 3, 3, dtype=F64)
    # (n, B, T, ·): one deterministic LSTM per draw; the previous states are zero (T > 1).
    z = torch.cat((x, zeros), -1) @ w.transpose(1, 2).unsqueeze(1) + b[:, None, None, :]
    i_gate, c_gate, o_gate = torch.sigmoid(z[..., 3:6]), torch.tanh(z[..., 6:9]), \
        torch.sigmoid(z[..., 9:])
    cell = i_gate * c_gate
    h = o_gate * torch.tanh(cell)
    for name, got, sample in (("m_C", layer.mu_c, cell), ("m_H", out.mu_a, h)):
        mc = monte_carlo(sample, sample)
        assert_close_mc(got, mc.mean, mc.mean_se, name)
    for name, got, sample in (("v_C", layer.var_c, cell), ("v_H", out.var_a, h)):
        mc = monte_carlo(sample, sample)
        assert_close_mc(got, mc.var, mc.var_se, name)
    gates = torch.sigmoid(z.view(n, 2, 3, 4, 3))
    gates[..., 2, :] = torch.tanh(z.view(n, 2, 3, 4, 3)[..., 2, :])
    mc = monte_carlo(gates, gates)
    assert_close_mc(layer.var_ga, mc.var, mc.var_se, "gate variances")
    without_cov = layer.var_c - layer.cov_i_c * (layer.cov_i_c + 2 * layer.mu_i_ga *
                                                 layer.mu_c_ga)
    mc = monte_carlo(cell, cell)
    assert float(((without_cov - mc.var).abs() / mc.var_se).max()) > 15
    without_cov = out.var_a - layer.cov_o_tanh_c * (layer.cov_o_tanh_c + 2 * layer.mu_o_ga *
                                                    layer.mu_ca)
    mc = monte_carlo(h, h)
    assert float(((without_cov - mc.var).abs() / mc.var_se).max()) > 15


def test_window_steps_are_independent_and_carry_nothing():
    """pytagi 0.2.1: for T > 1 (or B > 1) the previous states are zero, so step t of a window
    does not depend on the other steps, and nothing carries to the next call."""
    layer = _layer(2)
    x = torch.randn(2, 3, 2, generator=gen(3), dtype=F64)
    first = layer.forward(HiddenStates(x, None)).mu_a
    changed = x.clone()
    changed[:, 0] += 1.0
    again = layer.forward(HiddenStates(changed, None)).mu_a
    torch.testing.assert_close(again[:, 1:], first[:, 1:], rtol=0, atol=0)
    assert not torch.equal(again[:, 0], first[:, 0])
    torch.testing.assert_close(layer.forward(HiddenStates(x, None)).mu_a, first, rtol=0, atol=0)
    assert not layer.carries_states and not bool(layer.mu_h_prev.any())


def test_online_states_carry_from_call_to_call_and_reset():
    """seq_len 1, batch 1: each call starts from the last call's (h, c); reset_lstm_states()
    and a change of batch size start again from zero."""
    layer = _layer(4, t=1)
    xs = torch.randn(3, 1, 1, 2, generator=gen(5), dtype=F64)
    outs = []
    for x in xs:
        before = layer.lstm_states()
        out = layer.forward(HiddenStates(x, None))
        outs.append(out.mu_a)
        assert layer.carries_states
        if before[0] is not None:  # this call started from the last call's h and c
            assert layer.mu_h_prev is before[0] and layer.var_c_prev is before[3]
        mu_h, var_h, mu_c, var_c = layer.lstm_states()
        assert mu_h is out.mu_a and var_h is out.var_a
        assert mu_c is layer.mu_c and var_c is layer.var_c
    zero = torch.zeros(1, 1, 3, dtype=F64)
    torch.testing.assert_close(outs[0], _cell(layer.mu_w, layer.mu_b, xs[0], zero, zero)[0])
    layer.reset_lstm_states()
    torch.testing.assert_close(layer.forward(HiddenStates(xs[0], None)).mu_a, outs[0],
                               rtol=0, atol=0)
    layer.forward(HiddenStates(xs[1], None))
    layer.forward(HiddenStates(xs[:2].reshape(2, 1, 2), None))  # batch 2: reset, no carry
    assert not layer.carries_states and not bool(layer.mu_h_prev.any())
    torch.testing.assert_close(layer.forward(HiddenStates(xs[0], None)).mu_a, outs[0],
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"four arrays of B·3 values each.*\[3, 3, 3, 2\]"):
        layer.set_lstm_states(*[torch.zeros(3)] * 3, torch.zeros(2))


def test_to_another_dtype_drops_the_carried_states():
    """`Sequential.to()` rebuilds the storage and drops the carried states, so the next
    forward starts from zero in the new dtype (as after reset_lstm_states())."""
    manual_seed(25)
    net = Sequential(LSTM(2, 3, 1), Linear(3, 1), dtype=F64)
    x = torch.randn(1, 2, generator=gen(26), dtype=F64)
    first = net(x)[0]
    net(x)
    net.to(torch.float32)
    again = net(x)[0]
    assert again.dtype == torch.float32 and net.layers[0].mu_h_prior.dtype == torch.float32
    torch.testing.assert_close(again.double(), first, rtol=1e-6, atol=1e-7)


def test_network_reset_reaches_nested_lstms():
    manual_seed(6)
    net = Sequential(LayerBlock(LSTM(2, 3, 1)), LSTM(3, 3, 1), Linear(3, 1), dtype=F64)
    x = torch.randn(1, 2, generator=gen(7), dtype=F64)
    first = net(x)[0]
    assert not torch.equal(net(x)[0], first)
    net.reset_lstm_states()
    torch.testing.assert_close(net(x)[0], first, rtol=0, atol=0)


def test_backward_posterior_of_carried_states():
    """A training backward (batch 1, seq_len 1) replaces the carried h, c by pytagi's posterior:
    m_H + v_H δm, v_H + v_H² δv; with k = v_C J_tanh(C) m_o, m_C + k δm, v_C + k² δv."""
    layer = _layer(8, t=1)
    x = torch.randn(1, 1, 2, generator=gen(9), dtype=F64)
    out = layer.forward(HiddenStates(x, None))
    d_mu = torch.randn(1, 1, 3, generator=gen(10), dtype=F64)
    d_var = -torch.rand(1, 1, 3, generator=gen(11), dtype=F64)
    layer.backward(DeltaStates(d_mu, d_var), need_input_delta=False)
    mu_h, var_h, mu_c, var_c = layer.lstm_states()
    torch.testing.assert_close(mu_h, out.mu_a + out.var_a * d_mu)
    torch.testing.assert_close(var_h, out.var_a + out.var_a ** 2 * d_var)
    k = layer.var_c * (1 - torch.tanh(layer.mu_c) ** 2) * layer.mu_o_ga
    torch.testing.assert_close(mu_c, layer.mu_c + k * d_mu)
    torch.testing.assert_close(var_c, layer.var_c + k * k * d_var)


@pytest.mark.parametrize("carried", [False, True], ids=["window", "carried"])
def test_innovations_and_deltas_are_the_jacobians_of_the_mean_path(carried):
    """With deterministic inputs and previous states, m_H is a plain LSTM of the parameter
    means, and pytagi's backward is exactly TAGI's Linear rule with its Jacobian: for every
    parameter θ, g_m = Σ (∂m_H/∂θ) δm and g_v = Σ (∂m_H/∂θ)² δv over samples, steps and units,
    and for the input x, δm_x = J_x Σ_j (∂m_H,j/∂x) δm_j, δv_x = J_x² Σ_j (∂m_H,j/∂x)² δv_j
    (J_x the input's own Jacobian). Autograd of `_cell` is the oracle; `carried` gives the
    forget gate a non-zero previous cell (B = 1, T = 1)."""
    batch, t = (1, 1) if carried else (2, 3)
    layer = _layer(12, t=t, var_w=0.05)
    g = gen(13)
    x = torch.randn(batch, t, 2, generator=g, dtype=F64)
    jcb_in = 0.2 + torch.rand(batch, t, 2, generator=g, dtype=F64)
    h_prev = torch.zeros(batch, t, 3, dtype=F64)
    c_prev = torch.zeros(batch, t, 3, dtype=F64)
    if carried:
        h_prev, c_prev = torch.randn(2, 1, 1, 3, generator=g, dtype=F64)
        zero = torch.zeros_like(h_prev)
        layer.set_lstm_states(h_prev, zero, c_prev, zero)
    layer.forward(HiddenStates(x, None, jcb_in))
    d_mu = torch.randn(batch, t, 3, generator=g, dtype=F64)
    d_var = -torch.rand(batch, t, 3, generator=g, dtype=F64)
    back = layer.backward(DeltaStates(d_mu, d_var), need_input_delta=True)

    w, b = layer.mu_w.clone(), layer.mu_b.clone()
    jac_w, jac_b, jac_x = torch.func.jacrev(
        lambda w_, b_, x_: _cell(w_, b_, x_, h_prev, c_prev)[0], argnums=(0, 1, 2))(w, b, x)
    # jac_*: (B, T, O, *param shape); contract the output dims with δ.
    out_dims = 3
    for jac, got_m, got_v, name in ((jac_w, layer.delta_mu_w, layer.delta_var_w, "w"),
                                    (jac_b, layer.delta_mu_b, layer.delta_var_b, "b")):
        want_m = torch.tensordot(d_mu, jac, dims=out_dims)
        want_v = torch.tensordot(d_var, jac * jac, dims=out_dims)
        torch.testing.assert_close(got_m, want_m, msg=f"g_m of {name}")
        torch.testing.assert_close(got_v, want_v, msg=f"g_v of {name}")
    # ∂h[b,t,j]/∂x[b',t',k] is zero unless (b, t) = (b', t'): take the diagonal blocks.
    per_step = torch.stack([torch.stack([jac_x[bb, tt, :, bb, tt] for tt in range(t)])
                            for bb in range(batch)])  # (B, T, O, I)
    want_mu = jcb_in * torch.einsum("btj,btjk->btk", d_mu, per_step)
    want_var = jcb_in ** 2 * torch.einsum("btj,btjk->btk", d_var, per_step ** 2)
    torch.testing.assert_close(back.delta_mu, want_mu)
    torch.testing.assert_close(back.delta_var, want_var)
    assert carried or not bool(layer.delta_mu_w[:3].any()), \
        "window mode: the forget gate sees c_prev = 0 and gets no update"


def test_shapes_flat_inputs_and_linear_head():
    """(B, T, I), pytagi's flat (B, T·I) and (B·T·I,) give the same numbers; the output is
    every step's hidden state (B, T, O), which Linear(T·O, n) flattens."""
    manual_seed(14)
    net = Sequential(LSTM(2, 4, 3), LSTM(4, 4, 3), Linear(12, 1), dtype=F64)
    x = torch.randn(5, 3, 2, generator=gen(15), dtype=F64)
    want = net(x)
    for flat in (x.reshape(5, 6), x.reshape(-1), x.numpy().ravel()):
        got = net(flat)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert want[0].shape == (5, 1)
    assert Sequential(LSTM(2, 4, 3), dtype=F64)(x)[0].shape == (5, 3, 4)
    with pytest.raises(ValueError, match=r"expected input of shape \(batch, 3, 4\)"):
        Sequential(LSTM(2, 4, 3), LSTM(4, 4, 3), dtype=F64).layers[1].forward(
            HiddenStates(torch.zeros(5, 3, 2, dtype=F64), None))
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        LSTM(2, 4, 0)


def test_lstm_after_an_activation_applies_its_jacobian():
    """An LSTM fed by an activation multiplies its input innovations by that J (pytagi's LSTM
    does not; docs/tagi.md, Departures from pytagi): the first Linear's weight deltas equal the
    LSTM's innovations without J, times tanh's J, against the Linear's input."""
    manual_seed(16)
    net = Sequential(Linear(3, 6), Tanh(), LSTM(2, 3, 3), Linear(9, 1), dtype=F64)
    x = torch.randn(4, 3, generator=gen(17), dtype=F64)
    net(x)
    OutputUpdater().update(net.output_z_buffer, torch.randn(4, 1, generator=gen(18), dtype=F64),
                           0.1, net.input_delta_z_buffer)
    out_delta = DeltaStates(net.input_delta_z_buffer.delta_mu.clone(),
                            net.input_delta_z_buffer.delta_var.clone())
    net.backward()
    g_first = net.layers[0].delta_mu_w / net.layers[0].var_w
    # By hand: the head's innovations, then the LSTM's rule without the input J.
    lstm = net.layers[2]
    to_lstm = net.layers[3].backward(out_delta, True)
    lstm._jcb_in = None
    without_j = lstm.backward(to_lstm, True).delta_mu.reshape(4, 6)
    jcb = 1 - torch.tanh(x @ net.layers[0].mu_w.T + net.layers[0].mu_b) ** 2
    torch.testing.assert_close(g_first, (without_j * jcb).T @ x)
    assert not torch.allclose(g_first, without_j.T @ x, rtol=0.05)


def test_nested_block_save_load_and_state_dict_keys(tmp_path):
    manual_seed(19)
    net = Sequential(LayerBlock(LSTM(1, 3, 4), LSTM(3, 3, 4)), Linear(12, 1), dtype=F64)
    keys = list(net.state_dict())
    assert keys[:4] == ["0.0.mu_w", "0.0.var_w", "0.0.mu_b", "0.0.var_b"]
    assert net.state_dict()["0.1.mu_w"].shape == (12, 6)
    x = torch.randn(3, 4, 1, generator=gen(20), dtype=F64)
    regression_step(net, x, torch.randn(3, 1, generator=gen(21), dtype=F64), 0.2)
    path = tmp_path / "lstm.pt"
    net.save(str(path))
    manual_seed(22)
    other = Sequential(LayerBlock(LSTM(1, 3, 4), LSTM(3, 3, 4)), Linear(12, 1), dtype=F64)
    other.load(str(path))
    net.eval(), other.eval()
    torch.testing.assert_close(other(x)[0], net(x)[0], rtol=0, atol=0)
    wrong = Sequential(LayerBlock(LSTM(1, 4, 4), LSTM(4, 3, 4)), Linear(12, 1), dtype=F64)
    with pytest.raises(CheckpointError, match="does not fit"):
        wrong.load(str(path))


def test_float32_tracks_float64_and_training_reduces_error():
    """Same seed, two dtypes: a few training steps agree to float32 precision, and fitting one
    batch of a sine window task lowers its error (the network learns)."""
    t = torch.linspace(0, 6, 40, dtype=F64)
    series = torch.sin(t)
    x = torch.stack([series[i:i + 4] for i in range(32)]).unsqueeze(-1)  # (32, 4, 1)
    y = series[4:36].unsqueeze(-1)
    nets = {}
    for dtype in (torch.float32, F64):
        manual_seed(23)
        nets[dtype] = Sequential(LSTM(1, 8, 4), LSTM(8, 8, 4), Linear(32, 1), dtype=dtype)
    before = ((nets[F64].eval()(x)[0] - y) ** 2).mean()
    for net in nets.values():
        net.train()
        for _ in range(20):
            regression_step(net, x.to(net.dtype), y.to(net.dtype), 0.01)
    torch.testing.assert_close(nets[torch.float32].flat_params.double(), nets[F64].flat_params,
                               rtol=2e-3, atol=2e-4)
    after = ((nets[F64].eval()(x)[0] - y) ** 2).mean()
    assert after < 0.5 * before, (before.item(), after.item())


def test_init_follows_pytagi():
    """He: m ~ N(0, 1/(I+O)), v = gain²/(I+O); Xavier's fan-out is O."""
    manual_seed(24)
    layer = LSTM(6, 10, 2, gain_weight=2.0, gain_bias=0.5, dtype=F64)
    assert torch.allclose(layer.var_w, torch.full_like(layer.var_w, 4.0 / 16))
    assert torch.allclose(layer.var_b, torch.full_like(layer.var_b, 0.25 / 16))
    assert abs(layer.mu_w.std().item() - 0.25) < 0.03
    xavier = LSTM(6, 10, 2, init_method="Xavier", dtype=F64)
    assert torch.allclose(xavier.var_w, torch.full_like(xavier.var_w, 2.0 / 26))


def test_package_docstring_sequence_example_runs():
    """The sequence example in dptrain.tagi's docstring is kept runnable."""
    import textwrap

    import dptrain.tagi

    example = dptrain.tagi.__doc__.split("::")[3].split("\n(as in pytagi")[0]
    namespace: dict = {name: getattr(dptrain.tagi, name) for name in dptrain.tagi.__all__}
    namespace["torch"] = torch
    exec(textwrap.dedent(example), namespace)  # noqa: S102
    assert namespace["mu"].shape == (16, 1) and namespace["var"].shape == (16, 1)
