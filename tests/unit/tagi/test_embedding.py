"""Embedding against oracles: the lookup, the per-row sums of the deltas written out by loops,
the exact Gaussian posterior of one looked-up row, additivity, padding, bad ids, save/load
and nesting (docs/tagi.md, Embedding)."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import LSTM, Embedding, LayerBlock, Linear, ReLU, Sequential, manual_seed
from dptrain.tagi.states import DeltaStates, HiddenStates
from tests.unit.tagi.helpers import F64, deltas, gen, regression_step


def _table(seed: int, padding_idx: int = -1) -> Embedding:
    manual_seed(seed)
    layer = Embedding(5, 3, input_size=4, padding_idx=padding_idx, dtype=F64)
    layer.var_w.copy_(0.2 + torch.rand(5, 3, generator=gen(seed + 1), dtype=F64))
    return layer


IDS = torch.tensor([[1., 4., 1., 0.], [3., 3., 2., 4.]], dtype=F64)  # (B=2, N=4), repeats


@pytest.mark.parametrize("padding_idx", [-1, 0])
def test_lookup_and_deltas_match_loops(padding_idx):
    """Output (B, N·E): sample b's id j at columns [jE, (j+1)E), the table row (zeros for the
    padding id); deltas: Δm_W[k] = v_W[k] Σ δm, Δv_W[k] = v_W[k]² Σ δv over every position
    holding id k, none for the padding id; no innovations for the ids themselves."""
    layer = _table(0, padding_idx)
    out = layer.forward(HiddenStates(IDS, None))
    assert out.mu_a.shape == (2, 12) and out.jcb is None
    g = gen(2)
    delta = DeltaStates(torch.randn(2, 12, generator=g, dtype=F64),
                        -torch.rand(2, 12, generator=g, dtype=F64))
    assert layer.backward(delta, need_input_delta=False) is None
    layer.scale_deltas_()
    want_dm, want_dv = torch.zeros(5, 3, dtype=F64), torch.zeros(5, 3, dtype=F64)
    for b in range(2):
        for j in range(4):
            k = int(IDS[b, j])
            cols = slice(3 * j, 3 * j + 3)
            if k == padding_idx:
                assert torch.equal(out.mu_a[b, cols], torch.zeros(3, dtype=F64))
                assert torch.equal(out.var_a[b, cols], torch.zeros(3, dtype=F64))
                continue
            assert torch.equal(out.mu_a[b, cols], layer.mu_w[k])
            assert torch.equal(out.var_a[b, cols], layer.var_w[k])
            want_dm[k] += layer.var_w[k] * delta.delta_mu[b, cols]
            want_dv[k] += layer.var_w[k] ** 2 * delta.delta_var[b, cols]
    torch.testing.assert_close(layer.delta_mu_w, want_dm, rtol=1e-14, atol=0)
    torch.testing.assert_close(layer.delta_var_w, want_dv, rtol=1e-14, atol=0)
    back = layer.backward(delta, need_input_delta=True)
    assert back.delta_mu.shape == IDS.shape and not back.delta_mu.any()


def test_one_observed_row_gets_the_exact_gaussian_posterior():
    """One id, its embedding observed with noise σ² (cap inactive at batch 1): the step gives
    m + v (y − m)/(v + σ²) and v − v²/(v + σ²), the exact posterior (pytagi's Δv = v Σ δv
    would give v − v/(v + σ²))."""
    manual_seed(3)
    net = Sequential(Embedding(4, 2, input_size=1, scale=0.6), dtype=F64)
    prior_mu, prior_var = net.layers[0].mu_w.clone(), net.layers[0].var_w.clone()
    y, noise = torch.tensor([[0.9, -1.4]], dtype=F64), 0.3
    regression_step(net, torch.tensor([[2.0]], dtype=F64), y, noise)
    m, v = prior_mu[2], prior_var[2]
    torch.testing.assert_close(net.layers[0].mu_w[2], m + v * (y[0] - m) / (v + noise),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(net.layers[0].var_w[2], v - v * v / (v + noise), rtol=1e-14,
                               atol=0)
    others = [0, 1, 3]
    assert torch.equal(net.layers[0].mu_w[others], prior_mu[others])


def _id_net(dtype=F64) -> Sequential:
    manual_seed(4)
    return Sequential(Embedding(6, 3, input_size=3, padding_idx=5), Linear(9, 4), ReLU(),
                      Linear(4, 2), dtype=dtype)


def _ids(seed: int, batch: int) -> torch.Tensor:
    return torch.randint(0, 6, (batch, 3), generator=gen(seed)).to(F64)


def test_deltas_add_over_a_split_batch():
    """Rows looked up in both halves get the sum of the halves' deltas (docs/tagi.md,
    Data-parallel TAGI rests on this)."""
    x, y = _ids(5, 8), torch.randn(8, 2, generator=gen(6), dtype=F64)
    net = _id_net()
    regression_step(net, x, y, 0.2, do_step=False)
    whole = deltas(net)
    parts = []
    for half in (slice(0, 4), slice(4, 8)):
        regression_step(net, x[half], y[half], 0.2, do_step=False)
        parts.append(deltas(net))
    for key, value in whole.items():
        torch.testing.assert_close(value, parts[0][key] + parts[1][key], rtol=1e-12, atol=1e-15)


def test_flat_ids_float32_and_save_load(tmp_path):
    """pytagi's flat (B·N,) ids; float32 tracks float64; save/load round-trips the table."""
    x, y = _ids(7, 4), torch.randn(4, 2, generator=gen(8), dtype=F64)
    net64, net32 = _id_net(), _id_net(torch.float32)
    regression_step(net64, x.reshape(-1), y, 0.2)
    regression_step(net32, x.to(torch.float32), y.to(torch.float32), 0.2)
    for (key, a), (_, b) in zip(net64.named_parameter_tensors(), net32.named_parameter_tensors()):
        torch.testing.assert_close(b.double(), a, rtol=1e-5, atol=1e-6, msg=key)
    assert set(net64.state_dict()) >= {"0.mu_w", "0.var_w"} and "0.mu_b" not in net64.state_dict()
    net64.save(tmp_path / "emb.pt")
    fresh = _id_net()
    fresh.load(tmp_path / "emb.pt")
    assert torch.equal(fresh.flat_params, net64.flat_params)


def test_inside_a_block_it_trains_like_the_flat_network():
    """LayerBlock(Embedding, Linear) first: the same numbers as the flat network, and the
    table's keys one level deeper ("0.0.mu_w")."""
    flat = _id_net()
    manual_seed(4)
    nested = Sequential(LayerBlock(Embedding(6, 3, input_size=3, padding_idx=5), Linear(9, 4)),
                        ReLU(), Linear(4, 2), dtype=F64)
    assert torch.equal(nested.flat_params, flat.flat_params)
    assert "0.0.mu_w" in nested.state_dict()
    for step in range(2):
        x, y = _ids(10 + step, 5), torch.randn(5, 2, generator=gen(20 + step), dtype=F64)
        regression_step(flat, x, y, 0.2)
        regression_step(nested, x.reshape(-1), y, 0.2)
    assert torch.equal(nested.flat_params, flat.flat_params)


@pytest.mark.parametrize("ids, message", [
    ([[0., 6., 1.]], r"id 6\.0 at index \(0, 1\) is not a whole number in \[0, 6\)"),
    ([[0., 1.5, 1.]], r"id 1\.5 at index \(0, 1\)"),
    ([[2., 1., -1.]], r"id -1\.0 at index \(0, 2\)"),
])
def test_bad_ids_are_named(ids, message):
    manual_seed(0)
    net = Sequential(Embedding(6, 2, input_size=3), Linear(6, 1))
    with pytest.raises(ValueError, match=r"layer 0 \(Embedding\(6, 2\)\): " + message):
        net(torch.tensor(ids))


def test_bad_shapes_arguments_and_uncertain_ids():
    manual_seed(0)
    net = Sequential(Embedding(6, 2, input_size=3), Linear(6, 1))
    with pytest.raises(ValueError, match=r"Embedding\(6, 2\)\): expected ids of shape "
                                         r"\(batch, 3\), got \(2, 4\)"):
        net.layers[0].forward(HiddenStates(torch.zeros(2, 4), None))
    with pytest.raises(ValueError, match="ids must be known exactly"):
        net(torch.zeros(2, 3), torch.full((2, 3), 0.1))
    with pytest.raises(ValueError, match="padding_idx must be -1 .* got 6"):
        Embedding(6, 2, padding_idx=6)
    with pytest.raises(ValueError, match="embedding_dim must be an int >= 1, got 0"):
        Embedding(6, 0)
    with pytest.raises(ValueError, match="scale must be > 0"):
        Embedding(6, 2, scale=0.0)


def test_an_lstm_reads_the_embeddings_as_a_sequence():
    """(B, N·E) output = N steps of width E: step t of an LSTM(E, …, seq_len=N) sees id t's row,
    and the LSTM's innovations come back to the table."""
    manual_seed(9)
    net = Sequential(Embedding(5, 3, input_size=4), LSTM(3, 6, 4), Linear(24, 1), dtype=F64)
    ids = torch.tensor([[4., 0., 2., 4.], [1., 3., 3., 0.]], dtype=F64)
    regression_step(net, ids, torch.ones(2, 1, dtype=F64), 0.1, do_step=False)
    table = net.layers[0].mu_w
    assert torch.equal(net.layers[1].mu_ha[:, :, :3], table[ids.long()])
    assert bool((net.layers[0].delta_mu_w.abs().sum(1) > 0).all())


def test_each_backward_overwrites_the_table_deltas():
    """docs/tagi.md, Departures from pytagi: pytagi's CPU layer adds every backward to the last
    one's deltas; here a second backward on the same batch gives the same deltas, not twice."""
    net = _id_net()
    x, y = _ids(30, 4), torch.randn(4, 2, generator=gen(31), dtype=F64)
    regression_step(net, x, y, 0.2, do_step=False)
    first = deltas(net)
    regression_step(net, x, y, 0.2, do_step=False)
    assert first["0.delta_mu_w"].abs().sum() > 0
    for key, value in deltas(net).items():
        assert torch.equal(value, first[key]), key
