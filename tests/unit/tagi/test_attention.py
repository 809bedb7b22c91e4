"""MultiheadAttention and RMSNorm (dptrain.tagi): shapes, forward moments against Monte Carlo,
the state_dict round trip, and replays of cuTAGI main's recorded steps
(tests/data/cutagi_fixtures.npz, made by tests/data/make_cutagi_fixtures.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.tagi import (Linear, MultiheadAttention, OutputUpdater, ReLU, RMSNorm, Sequential,
                          manual_seed)
from dptrain.tagi import rmsnorm as rmsnorm_module
from dptrain.tagi.states import DeltaStates, HiddenStates
from tests.unit.pytagi.parity import load_case, replay

CUTAGI = __import__("pathlib").Path(__file__).resolve().parents[2] / "data" / \
    "cutagi_fixtures.npz"
F64 = torch.float64


@pytest.mark.parametrize("heads,kv,rope", [(2, 2, True), (4, 2, True), (2, 1, False)])
def test_shapes_flat_and_3d(heads, kv, rope):
    manual_seed(0)
    layer = MultiheadAttention(8, heads, kv, use_rope=rope, dtype=F64)
    assert layer.mu_w.shape == ((heads + 2 * kv) * (8 // heads), 8)
    x = torch.randn(3, 5 * 8, dtype=F64)
    out = layer.forward(HiddenStates(x, torch.full_like(x, 0.1)))
    assert out.mu_a.shape == x.shape and bool((out.var_a > 0).all())
    out3 = layer.forward(HiddenStates(x.view(3, 5, 8), torch.full_like(x, 0.1).view(3, 5, 8)))
    torch.testing.assert_close(out3.mu_a.reshape(3, 40), out.mu_a, rtol=0, atol=0)
    back = layer.backward(DeltaStates(torch.randn(3, 5, 8, dtype=F64),
                                      -torch.rand(3, 5, 8, dtype=F64)), True)
    assert back.delta_mu.shape == (3, 5, 8) and bool(torch.isfinite(back.delta_var).all())


def test_causal_mask_keeps_the_past_independent_of_the_future():
    manual_seed(1)
    layer = MultiheadAttention(4, 2, dtype=F64).eval()
    x = torch.randn(1, 6 * 4, dtype=F64)
    y = x.clone()
    y[0, 5 * 4:] += 3.0  # change only the last position
    a, b = layer.forward(HiddenStates(x, None)), layer.forward(HiddenStates(y, None))
    # cuTAGI's mask zeroes the future scores before Remax, whose floor leaves them a small
    # weight; dptrain zeroes those weights after it: the past does not move at all.
    assert torch.equal(a.mu_a[0, :20], b.mu_a[0, :20])
    assert torch.equal(a.var_a[0, :20], b.var_a[0, :20])
    assert not torch.allclose(a.mu_a[0, 20:], b.mu_a[0, 20:])


def test_bad_configurations_are_one_line_errors():
    with pytest.raises(ValueError, match="num_kv_heads 3 does not divide"):
        MultiheadAttention(12, 4, 3)
    with pytest.raises(ValueError, match="must be even"):
        MultiheadAttention(6, 2)
    with pytest.raises(ValueError, match="expected input"):
        MultiheadAttention(8, 2).forward(HiddenStates(torch.randn(2, 12), None))


def test_rmsnorm_forward_matches_monte_carlo():
    """With the RMS a constant (cuTAGI's rule), Z = r A γ is a product of independent
    Gaussians: sample A and γ and compare the first two moments."""
    manual_seed(2)
    norm = RMSNorm(6, dtype=F64)
    norm.var_w.fill_(0.05)
    mu_a, var_a = torch.randn(2, 6, dtype=F64), torch.rand(2, 6, dtype=F64) * 0.2
    out = norm.forward(HiddenStates(mu_a, var_a))
    r = torch.rsqrt((mu_a ** 2).mean(1, keepdim=True) + norm.eps)
    gen = torch.Generator().manual_seed(0)
    n = 400_000
    a = mu_a + var_a.sqrt() * torch.randn((n, 2, 6), generator=gen, dtype=F64)
    g = norm.mu_w + norm.var_w.sqrt() * torch.randn((n, 1, 6), generator=gen, dtype=F64)
    z = r * a * g
    torch.testing.assert_close(z.mean(0), out.mu_a, rtol=0, atol=5e-3)
    torch.testing.assert_close(z.var(0), out.var_a, rtol=2e-2, atol=1e-3)


def test_state_dict_round_trip_is_bit_identical():
    def build():
        manual_seed(5)
        return Sequential(Linear(3, 16), MultiheadAttention(4, 2, 1), RMSNorm(4),
                          Linear(16, 2), dtype=F64)
    from dptrain.tagi import OutputUpdater
    x, y = torch.randn(4, 3, dtype=F64), torch.randn(4, 2, dtype=F64)

    def step(net):
        net(x)
        OutputUpdater(net.device).update(net.output_z_buffer, y, 0.1, net.input_delta_z_buffer)
        net.backward()
        net.step()

    a = build()
    step(a)
    saved = {k: v.clone() for k, v in a.state_dict().items()}
    step(a)
    b = build()
    b.load_state_dict(saved)
    step(b)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def _cutagi_rms_variance(mu_a, var_a, r, mu_w, var_w):
    """cuTAGI main's v_Z: the correct form times one more v_A."""
    if var_a is None:
        return torch.zeros_like(mu_a)
    return (var_a * r * r) * (var_a * (var_w + mu_w * mu_w) + var_w * mu_a * mu_a)


def test_rmsnorm_forward_replays_cutagi_main_and_its_gamma_deltas_lack_v(monkeypatch):
    """With cuTAGI main's v_Z swapped in, the recorded first forward is reproduced; its γ deltas
    are ours without the v_γ (Δm) and v_γ² (Δv) factors of the innovation rule (cuTAGI's
    RMSNorm omits them; its LayerNorm has them), so the later steps differ by design
    (docs/tagi.md, Departures from cuTAGI main)."""
    from dptrain.tagi import OutputUpdater
    monkeypatch.setattr(rmsnorm_module, "rms_variance", _cutagi_rms_variance)
    case = load_case("rmsnorm", CUTAGI)
    net = Sequential(Linear(5, 8), RMSNorm([8]), Linear(8, 2), dtype=F64)
    state = net.state_dict()
    net.load_state_dict({k: torch.as_tensor(case.init[k], dtype=F64).reshape(v.shape)
                         for k, v in state.items()})
    mu, var = net(torch.as_tensor(case["x0"], dtype=F64))
    np.testing.assert_allclose(mu.numpy().ravel(), case["step0/out_mu"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(var.numpy().ravel(), case["step0/out_var"], rtol=1e-5,
                               atol=1e-7)
    OutputUpdater(net.device).update(net.output_z_buffer, torch.as_tensor(case["y0"], dtype=F64),
                                     torch.as_tensor(case["var_y0"], dtype=F64),
                                     net.input_delta_z_buffer)
    net.backward()
    gamma = net.layers[1]
    np.testing.assert_allclose((gamma.delta_mu_w / gamma.var_w).numpy(),
                               case["step0/1.delta_mu_w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose((gamma.delta_var_w / gamma.var_w ** 2).numpy(),
                               case["step0/1.delta_var_w"], rtol=1e-5, atol=1e-7)


def _cutagi_split_qkv(mu_p, var_p, batch, steps, heads, kv_heads, head_dim):
    """cuTAGI main's reading of the (B·T, P) projection buffer: with the strides of a
    (3, B, T, E) array, zeros past its end (docs/tagi.md, Departures from cuTAGI main: 1)."""
    size = 3 * batch * steps * heads * head_dim
    parts = []
    for t in (mu_p, var_p):
        flat = torch.cat([t.reshape(-1), t.new_zeros(size - t.numel())])
        parts.append(flat.view(3, batch, steps, heads, head_dim).transpose(2, 3))
    return tuple((parts[0][i], parts[1][i]) for i in range(3))


@pytest.mark.recorded
def test_attention_forward_replays_cutagi_main_with_its_buffer_layout(monkeypatch):
    """One position (T = 1), batch 4, Linear → MultiheadAttention(8, 2) → Linear, with the
    parameters cuTAGI main drew: with cuTAGI's reading of the projection buffer swapped in
    (departure 1: a batch row's query, key and value come from other rows' projections), the
    recorded first forward is reproduced to 1e-5; with dptrain's own reading it is not, so
    the layout is the whole difference in the forward. (Its backward departs further:
    departures 2-4, not replayed.) Tolerance: float64 here against cuTAGI's float32, which
    another CPU's kernels cannot break."""
    from dptrain.tagi import attention as attention_module
    case = load_case("attn_t1", CUTAGI)

    def forward() -> tuple[np.ndarray, np.ndarray]:
        net = Sequential(Linear(3, 8), MultiheadAttention(8, 2, 2, use_rope=True,
                                                          max_seq_len=2048),
                         Linear(8, 2), dtype=F64)
        net.load_state_dict({k: torch.as_tensor(case.init[k], dtype=F64).reshape(v.shape)
                             for k, v in net.state_dict().items()})
        mu, var = net(torch.as_tensor(case["x0"], dtype=F64))
        return mu.numpy().ravel(), var.numpy().ravel()

    ours = forward()
    assert not np.allclose(ours[0], case["step0/out_mu"], rtol=0.1)
    monkeypatch.setattr(attention_module, "split_qkv", _cutagi_split_qkv)
    mu, var = forward()
    np.testing.assert_allclose(mu, case["step0/out_mu"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(var, case["step0/out_var"], rtol=1e-5, atol=1e-7)


def test_native_step_declines_networks_with_the_transformer_layers():
    from dptrain.tagi.native import NotNative, check_network
    net = Sequential(Linear(3, 16), MultiheadAttention(4, 2), RMSNorm(4), Linear(16, 2))
    with pytest.raises(NotNative, match="not MultiheadAttention, RMSNorm"):
        check_network(net)


def test_a_score_scale_is_the_same_network_as_queries_scaled_by_it():
    """score_scale c (dptrain's, cuTAGI has none: c = 1) multiplies each score's mean by c and
    its variance by c²: the same forward as c = 1 with the query weights' means times c and
    variances times c², and after one full step the two networks still agree (the query
    weights' deltas of the second are those of the first times c)."""
    c, e = 0.25, 8
    nets = []
    for scale in (c, 1.0):
        manual_seed(3)
        nets.append(Sequential(Linear(3, 4 * e),
                               MultiheadAttention(e, 2, bias=False, score_scale=scale),
                               dtype=torch.float64))
    attention = nets[1].layers[1]
    queries = slice(0, attention.num_heads * attention.head_dim)
    with torch.no_grad():
        attention.mu_w[queries] *= c
        attention.var_w[queries] *= c * c
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y = torch.randn(5, 4 * e, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    outputs = []
    for net in nets:
        net.train()
        first = net(x)
        OutputUpdater().update(net.output_z_buffer, y, 0.3, net.input_delta_z_buffer)
        net.backward()
        net.step()
        outputs.append((*first, *net(x)))
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="score_scale must be > 0"):
        MultiheadAttention(e, 2, score_scale=0.0)
