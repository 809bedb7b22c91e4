"""OutputUpdater (docs/tagi.md, Output update): formulas, index updates, masking."""

from __future__ import annotations

import numpy as np
import torch

from dptrain.tagi import DeltaStates, HiddenStates, Linear, OutputUpdater, Sequential, manual_seed
from tests.unit.tagi.helpers import F64, gen


def _output(jcb: bool = False) -> HiddenStates:
    g = gen(31)
    mu = torch.randn(3, 4, generator=g, dtype=F64)
    var = torch.rand(3, 4, generator=g, dtype=F64) + 0.1
    return HiddenStates(mu, var, torch.rand(3, 4, generator=g, dtype=F64) if jcb else None)


def test_update_formula_with_and_without_jacobian():
    for with_jcb in (False, True):
        out = _output(with_jcb)
        y = torch.randn(3, 4, generator=gen(32), dtype=F64)
        delta = DeltaStates()
        OutputUpdater().update(out, y, 0.25, delta)
        j = out.jcb_or_ones()
        torch.testing.assert_close(delta.delta_mu, j * (y - out.mu_a) / (out.var_a + 0.25))
        torch.testing.assert_close(delta.delta_var, -(j**2) / (out.var_a + 0.25))
        assert bool((delta.delta_var <= 0).all())


def test_nan_targets_are_missing_observations():
    """A NaN target gives zero innovation, and so no parameter delta from that output."""
    out = _output()
    y = torch.randn(3, 4, generator=gen(33), dtype=F64)
    y[1, 2] = float("nan")
    delta = DeltaStates()
    OutputUpdater().update(out, y, 0.25, delta)
    assert delta.delta_mu[1, 2] == 0 and delta.delta_var[1, 2] == 0
    assert bool(torch.isfinite(delta.delta_mu).all()) and int((delta.delta_mu == 0).sum()) == 1

    manual_seed(0)
    net = Sequential(Linear(2, 2), dtype=F64)
    net(torch.ones(1, 2))
    OutputUpdater().update(net.output_z_buffer, [[float("nan"), 1.0]], 0.1,
                           net.input_delta_z_buffer)
    net.backward()
    layer = net.layers[0]
    assert bool((layer.delta_mu_w[0] == 0).all()) and layer.delta_mu_b[0] == 0
    assert bool((layer.delta_mu_w[1] != 0).all())


def test_update_accepts_flat_numpy_targets_and_per_element_noise():
    """pytagi passes flat float32 arrays; the output's dtype and shape are used."""
    out = _output()
    y = np.arange(12, dtype=np.float32) / 10
    var_obs = np.full(12, 0.3, dtype=np.float32)
    delta = DeltaStates()
    OutputUpdater().update(out, y, var_obs, delta)
    y_t = torch.as_tensor(y, dtype=F64).view(3, 4)
    torch.testing.assert_close(delta.delta_mu, (y_t - out.mu_a) / (out.var_a + 0.3))
    assert delta.delta_mu.dtype == F64


def test_update_using_indices_touches_only_selected_outputs():
    out = _output(jcb=True)
    idx = torch.tensor([[1, 3], [4, 2], [2, 1]])  # 1-based
    y = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0]], dtype=F64)
    delta = DeltaStates()
    OutputUpdater().update_using_indices(out, y, 0.01, idx, delta)
    expected_mu = torch.zeros(3, 4, dtype=F64)
    expected_var = torch.zeros(3, 4, dtype=F64)
    for b in range(3):
        for k in range(2):
            j = idx[b, k] - 1
            s = out.var_a[b, j] + 0.01
            expected_mu[b, j] = out.jcb[b, j] * (y[b, k] - out.mu_a[b, j]) / s
            expected_var[b, j] = -out.jcb[b, j] ** 2 / s
    torch.testing.assert_close(delta.delta_mu, expected_mu)
    torch.testing.assert_close(delta.delta_var, expected_var)


def test_update_using_indices_flat_arrays_and_nan_mask():
    out = _output()
    idx = np.array([1, 2, 3, 4, 2, 3], dtype=np.int32)  # flat (B·L,), pytagi style
    y = np.array([1.0, np.nan, -1.0, 1.0, 1.0, -1.0], dtype=np.float32)
    delta = DeltaStates()
    OutputUpdater().update_using_indices(out, y, np.full(6, 0.01), idx, delta)
    assert delta.delta_mu[0, 1] == 0 and delta.delta_var[0, 1] == 0  # the NaN observation
    assert int((delta.delta_mu != 0).sum()) == 5
