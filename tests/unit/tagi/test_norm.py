"""BatchNorm2d and LayerNorm: forward, innovations, deltas and running statistics against a
direct element-by-element re-derivation of their formulas (float64), Monte Carlo for the
forward moments, state handling, and errors."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.errors import CheckpointError
from dptrain.tagi import BatchNorm2d, LayerNorm, Linear, ReLU, Sequential, manual_seed
from dptrain.tagi.norm import combine_moments, moments
from dptrain.tagi.states import DeltaStates, HiddenStates
from tests.unit.tagi.helpers import F64, deltas, gen, regression_step


def _states(shape, seed):
    g = gen(seed)
    mu = torch.randn(shape, generator=g, dtype=F64)
    var = torch.rand(shape, generator=g, dtype=F64) * 0.5
    jcb = torch.rand(shape, generator=g, dtype=F64) + 0.2
    delta_mu = torch.randn(shape, generator=g, dtype=F64)
    delta_var = -torch.rand(shape, generator=g, dtype=F64)
    return HiddenStates(mu, var, jcb), DeltaStates(delta_mu, delta_var)


def _randomise(net, seed):
    g = gen(seed)
    for name, t in net.named_parameter_tensors():
        t.copy_(torch.rand(t.shape, generator=g, dtype=F64) * 0.5 +
                (0.1 if ".var_" in name else 0.5))


def _reference(mu, var, jcb, dmu, dvar, groups, eps, gw, gb, stats=None):
    """Element by element: `groups` lists, per (statistics group), the indices of the values
    it normalises; `gw`/`gb` map an index to its γ/β = (mean, var). Returns the outputs, the
    input innovations, and per-parameter-index delta sums, straight from the formulas."""
    mu_z, var_z = torch.zeros_like(mu), torch.zeros_like(mu)
    dmu_in, dvar_in = torch.zeros_like(mu), torch.zeros_like(mu)
    g_w: dict = {}
    g_b: dict = {}
    used = []
    for gi, idx in enumerate(groups):
        if stats is None:
            n = len(idx)
            mean = sum(mu[i].item() for i in idx) / n
            s2 = (sum((mu[i].item() - mean) ** 2 for i in idx) +
                  sum(var[i].item() for i in idx)) / (n - 1)
        else:
            mean, s2 = stats[gi]
        used.append((mean, s2))
        r = 1.0 / math.sqrt(s2 + eps)
        for i in idx:
            (mw, vw), (mb, vb), key = gw(i), gb(i), gw(i, key=True)
            c = mu[i].item() - mean
            mu_z[i] = r * c * mw + mb
            var_z[i] = r * r * (var[i].item() * (mw * mw + vw) + vw * c * c) + vb
            t = r * mw * jcb[i].item()
            dmu_in[i] = t * dmu[i].item()
            dvar_in[i] = t * t * dvar[i].item()
            a, b = g_w.get(key, (0.0, 0.0))
            g_w[key] = (a + vw * r * c * dmu[i].item(), b + (vw * r * c) ** 2 * dvar[i].item())
            a, b = g_b.get(key, (0.0, 0.0))
            g_b[key] = (a + vb * dmu[i].item(), b + vb * vb * dvar[i].item())
    return mu_z, var_z, dmu_in, dvar_in, g_w, g_b, used


def _run_layer(layer, states, delta):
    net = Sequential(layer, dtype=F64)  # float64 views of the flat buffers
    _randomise(net, 5)
    out = layer.forward(states)
    back = layer.backward(delta, True)
    layer.scale_deltas_()
    return out, back


def _check(layer, out, back, ref, channels):
    mu_z, var_z, dmu_in, dvar_in, g_w, g_b, _ = ref
    torch.testing.assert_close(out.mu_a, mu_z, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.var_a, var_z, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(back.delta_mu, dmu_in, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(back.delta_var, dvar_in, rtol=1e-12, atol=1e-12)
    want = torch.tensor([g_w[c] for c in range(channels)], dtype=F64)
    torch.testing.assert_close(torch.stack([layer.delta_mu_w, layer.delta_var_w], 1), want,
                               rtol=1e-12, atol=1e-12)
    want = torch.tensor([g_b[c] for c in range(channels)], dtype=F64)
    torch.testing.assert_close(torch.stack([layer.delta_mu_b, layer.delta_var_b], 1), want,
                               rtol=1e-12, atol=1e-12)


def _param(layer, group):
    def get(i, key=False):
        c = i[1]
        return c if key else (getattr(layer, f"mu_{group}")[c].item(),
                              getattr(layer, f"var_{group}")[c].item())
    return get


@pytest.mark.parametrize("shape", [(5, 3), (3, 2, 2, 3)])
def test_batchnorm_training_equals_its_formulas(shape):
    """Per feature over the batch (B, C), per channel over batch and positions (B, C, H, W)."""
    states, delta = _states(shape, 1)
    layer = BatchNorm2d(shape[1])
    out, back = _run_layer(layer, states, delta)
    index = list(torch.cartesian_prod(*[torch.arange(n) for n in shape]).tolist())
    groups = [[tuple(i) for i in index if i[1] == c] for c in range(shape[1])]
    ref = _reference(states.mu_a, states.var_a, states.jcb, delta.delta_mu, delta.delta_var,
                     groups, 1e-5, _param(layer, "w"), _param(layer, "b"))
    _check(layer, out, back, ref, shape[1])
    used = torch.tensor(ref[6], dtype=F64)
    torch.testing.assert_close(layer.mu_norm_batch, used[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.var_norm_batch, used[:, 1], rtol=1e-12, atol=1e-12)
    # The first training batch sets the running statistics to its own.
    torch.testing.assert_close(layer.mu_ra, used[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.var_ra, used[:, 1], rtol=1e-12, atol=1e-12)
    assert layer.num_batches_tracked.item() == 1


@pytest.mark.parametrize("shape", [(4, 5), (3, 2, 2, 3)])
def test_layernorm_equals_its_formulas(shape):
    """Per sample over all its values; γ, β per feature (B, N) or per channel (B, C, H, W)."""
    states, delta = _states(shape, 2)
    layer = LayerNorm(list(shape[1:]))
    out, back = _run_layer(layer, states, delta)
    index = list(torch.cartesian_prod(*[torch.arange(n) for n in shape]).tolist())
    groups = [[tuple(i) for i in index if i[0] == b] for b in range(shape[0])]
    ref = _reference(states.mu_a, states.var_a, states.jcb, delta.delta_mu, delta.delta_var,
                     groups, 1e-4, _param(layer, "w"), _param(layer, "b"))
    _check(layer, out, back, ref, shape[1])
    layer.eval()  # no running statistics: evaluation computes the same
    again = layer.forward(states)
    assert torch.equal(again.mu_a, out.mu_a) and torch.equal(again.var_a, out.var_a)


def test_forward_moments_monte_carlo():
    """For fixed statistics, Z = r (A − μ) γ + β with independent Gaussian A, γ, β has exactly
    the forward's mean and variance."""
    states, _ = _states((6, 2), 3)
    layer = BatchNorm2d(2)
    net = Sequential(layer, dtype=F64)
    _randomise(net, 4)
    out = layer.forward(states)
    mean, var = layer.mu_norm_batch, layer.var_norm_batch
    n, g = 400_000, gen(9)
    a = states.mu_a + states.var_a.sqrt() * torch.randn((n,) + states.mu_a.shape, generator=g,
                                                         dtype=F64)
    gamma = layer.mu_w + layer.var_w.sqrt() * torch.randn(n, 1, 2, generator=g, dtype=F64)
    beta = layer.mu_b + layer.var_b.sqrt() * torch.randn(n, 1, 2, generator=g, dtype=F64)
    z = (a - mean) / torch.sqrt(var + layer.eps) * gamma + beta
    se_mean = (z.var(0) / n).sqrt()
    assert bool(((z.mean(0) - out.mu_a).abs() <= 5 * se_mean).all())
    se_var = z.var(0) * math.sqrt(2.0 / n) * 1.5  # fourth moments: a generous bound
    assert bool(((z.var(0) - out.var_a).abs() <= 5 * se_var).all())


def test_running_statistics_momentum_and_evaluation():
    """ra ← momentum·ra + (1 − momentum)·batch after the first batch; eval normalises with the
    running statistics and changes no state."""
    layer = BatchNorm2d(3, momentum=0.8)
    net = Sequential(layer, dtype=F64)
    batches = [_states((4, 3, 2, 2), s)[0] for s in (10, 11, 12)]
    net.eval()  # an evaluation forward first: the first *training* batch still sets the stats
    layer.forward(batches[2])
    net.train()
    mu_ra, var_ra = None, None
    for states in batches:
        layer.forward(states)
        if mu_ra is None:
            mu_ra, var_ra = layer.mu_norm_batch.clone(), layer.var_norm_batch.clone()
        else:
            mu_ra = 0.8 * mu_ra + 0.2 * layer.mu_norm_batch
            var_ra = 0.8 * var_ra + 0.2 * layer.var_norm_batch
    torch.testing.assert_close(layer.mu_ra, mu_ra, rtol=1e-14, atol=0)
    torch.testing.assert_close(layer.var_ra, var_ra, rtol=1e-14, atol=0)
    assert layer.num_batches_tracked.item() == 3
    before = net.flat_state.clone()
    net.eval()
    states = batches[0]
    out = layer.forward(states)
    r = 1 / torch.sqrt(var_ra + layer.eps).view(1, 3, 1, 1)
    torch.testing.assert_close(out.mu_a, (states.mu_a - mu_ra.view(1, 3, 1, 1)) * r,
                               rtol=1e-12, atol=1e-12)  # γ = 1, β = 0 at init
    assert torch.equal(net.flat_state, before)


def test_single_value_statistics_are_an_error_naming_the_layer():
    net = Sequential(Linear(3, 4), BatchNorm2d(4), dtype=F64)
    with pytest.raises(ValueError, match=r"layer 1 \(BatchNorm2d\(4\)\): batch statistics over "
                                         r"a single value per feature \(input \(1, 4\)\)"):
        net(torch.ones(1, 3, dtype=F64))
    net.eval()
    net(torch.ones(1, 3, dtype=F64))  # evaluation uses the running statistics: fine
    image = Sequential(BatchNorm2d(2), dtype=F64)
    image(torch.randn(1, 2, 2, 2, dtype=F64))  # one image still has 4 values per channel
    with pytest.raises(ValueError, match="single value per channel"):
        Sequential(BatchNorm2d(2), dtype=F64)(torch.randn(1, 2, 1, 1, dtype=F64))
    with pytest.raises(ValueError, match="LayerNorm: statistics over a single value"):
        LayerNorm([1])


def test_input_checks_and_mode_fixed_by_the_first_input():
    net = Sequential(BatchNorm2d(3), dtype=F64)
    with pytest.raises(ValueError, match=r"layer 0 \(BatchNorm2d\(3\)\): expected input "
                                         r"\(batch, 3\) or \(batch, 3, H, W\), got \(4, 5\)"):
        net(torch.randn(4, 5, dtype=F64))
    net(torch.randn(4, 3, 2, 2, dtype=F64))
    with pytest.raises(ValueError, match=r"normalises 4-d inputs \(decided by its first "
                                         r"input\), got \(4, 3\)"):
        net(torch.randn(4, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"LayerNorm\(\[6\]\)\): expected input \(batch, 6\), "
                                         r"got \(2, 5\)"):
        Sequential(LayerNorm(6), dtype=F64)(torch.randn(2, 5, dtype=F64))
    with pytest.raises(ValueError, match="normalized_shape must be"):
        LayerNorm([2, 3])
    with pytest.raises(ValueError, match="momentum must be in"):
        BatchNorm2d(3, momentum=1.5)


def test_initial_gamma_beta_follow_pytagi():
    bn = BatchNorm2d(4, gain_weight=2.0, gain_bias=0.5)
    assert torch.equal(bn.mu_w, torch.ones(4)) and torch.equal(bn.mu_b, torch.zeros(4))
    torch.testing.assert_close(bn.var_w, torch.full((4,), 4.0 / 4))
    torch.testing.assert_close(bn.var_b, torch.full((4,), 0.25 / 4))
    assert BatchNorm2d(4, bias=False).param_groups() == [("w", (4,))]
    assert torch.equal(bn.mu_ra, torch.zeros(4)) and torch.equal(bn.var_ra, torch.ones(4))


def test_combined_moments_equal_the_moments_of_the_whole():
    """Pooling per-part (n, mean, M2) — unequal parts — gives the whole batch's statistics."""
    g = gen(3)
    mu = torch.randn(11, 4, generator=g, dtype=F64) * 3 + 100  # offset: cancellation-prone
    var = torch.rand(11, 4, generator=g, dtype=F64)
    rows = []
    for part in (slice(0, 1), slice(1, 5), slice(5, 11)):
        n, mean, m2 = moments(mu[part], var[part], (0,))
        rows.append(torch.cat([torch.tensor([float(n)], dtype=F64), mean[0], m2[0]]))
    n, mean, m2 = combine_moments(torch.stack(rows))
    n_all, mean_all, m2_all = moments(mu, var, (0,))
    assert n == n_all == 11
    torch.testing.assert_close(mean, mean_all[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(m2, m2_all[0], rtol=1e-12, atol=0)


def _bn_net(seed=0):
    manual_seed(seed)
    return Sequential(Linear(4, 6), BatchNorm2d(6), ReLU(), Linear(6, 2), dtype=F64)


def _train(net, steps, seed=20):
    g = gen(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g, dtype=F64)
        regression_step(net, x, torch.randn(8, 2, generator=g, dtype=F64), 0.2)


def test_state_dict_save_load_and_to_cover_running_statistics(tmp_path):
    net = _bn_net()
    _train(net, 3)
    state = net.state_dict()
    assert {"1.mu_ra", "1.var_ra", "1.num_batches_tracked"} <= set(state)
    assert state["1.num_batches_tracked"].item() == 3
    fresh = _bn_net(seed=1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.flat_state, net.flat_state)
    # The loaded counter matters: the next batch blends instead of overwriting.
    _train(fresh, 1, seed=30)
    _train(net, 1, seed=30)
    assert torch.equal(fresh.flat_state, net.flat_state)
    path = tmp_path / "bn.pt"
    net.save(str(path))
    other = _bn_net(seed=2)
    other.load(str(path))
    assert torch.equal(other.flat_state, net.flat_state)
    assert torch.equal(other.flat_params, net.flat_params)
    net.to(torch.float32)
    assert net.flat_state.dtype == torch.float32
    assert dict(net.named_state_tensors())["1.mu_ra"].data_ptr() == \
        net.layers[1].mu_ra.data_ptr()
    torch.testing.assert_close(net.layers[1].var_ra, other.layers[1].var_ra.float())
    bad = dict(state, **{"1.var_ra": -state["1.var_ra"]})
    with pytest.raises(ValueError, match=r"state_dict\['1.var_ra'\] holds variances <= 0"):
        fresh.load_state_dict(bad)
    bad = dict(state, **{"1.num_batches_tracked": torch.tensor(1.5, dtype=F64)})
    with pytest.raises(ValueError, match="must be a whole number >= 0"):
        fresh.load_state_dict(bad)
    missing = {k: v for k, v in state.items() if not k.endswith("mu_ra")}
    with pytest.raises(ValueError, match=r"missing keys \['1.mu_ra'\]"):
        fresh.load_state_dict(missing)
    plain = Sequential(Linear(4, 6), ReLU(), Linear(6, 2), dtype=F64)
    with pytest.raises(CheckpointError, match="does not fit"):
        plain.load(str(path))


def test_layernorm_deltas_add_over_batch_splits():
    net = Sequential(Linear(4, 6), LayerNorm(6), ReLU(), Linear(6, 2), dtype=F64)
    g = gen(4)
    x, y = torch.randn(9, 4, generator=g, dtype=F64), torch.randn(9, 2, generator=g, dtype=F64)
    regression_step(net, x, y, 0.1, do_step=False)
    whole = deltas(net)
    parts = []
    for sl in (slice(0, 4), slice(4, 5), slice(5, 9)):
        regression_step(net, x[sl], y[sl], 0.1, do_step=False)
        parts.append(deltas(net))
    for name, value in whole.items():
        torch.testing.assert_close(sum(p[name] for p in parts), value, rtol=1e-10, atol=1e-15)
