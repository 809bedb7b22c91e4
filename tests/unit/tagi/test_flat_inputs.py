"""pytagi's flat arrays in `dptrain.tagi` where they are unambiguous, a one-line refusal naming
the expected shape where they are not, and never a silent (B, 1) - (B,) broadcast (issue 29;
docs/design.md, contract 6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.tagi import Linear, OutputUpdater, ReLU, Sequential, manual_seed


def _net(inputs: int = 3) -> Sequential:
    manual_seed(0)
    return Sequential(Linear(inputs, 8), ReLU(), Linear(8, 1))


def test_a_flat_input_is_whole_samples_of_the_first_linear():
    net = _net(3)
    x = torch.randn(5, 3)
    mu, var = net(x)
    flat_mu, flat_var = net(x.reshape(-1).numpy())
    assert flat_mu.shape == (5, 1)
    assert torch.equal(mu, flat_mu) and torch.equal(var, flat_var)


def test_one_input_per_sample_as_a_flat_batch():
    """The 1-D regression tutorials pass x of shape (B,) to Linear(1, ...)."""
    net = _net(1)
    x = torch.linspace(-1, 1, 7)
    assert torch.equal(net(x)[0], net(x[:, None])[0])


def test_a_flat_input_that_is_not_whole_samples_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^mu_x has shape \(7,\): a flat input must hold whole "
                                         r"samples of 3 = 3 values \(the first layer's input "
                                         r"shape\)$"):
        _net(3)(np.zeros(7, dtype=np.float32))


def test_flat_targets_update_like_column_targets():
    """(B,) targets for a (B, 1) output: the same innovations, not a (B, B) broadcast."""
    net, updater = _net(2), OutputUpdater()
    x, y = torch.randn(4, 2), torch.randn(4)
    net(x)
    updater.update(net.output_z_buffer, y, 0.1, net.input_delta_z_buffer)
    flat = net.input_delta_z_buffer.delta_mu.clone()
    updater.update(net.output_z_buffer, y[:, None], torch.full((4, 1), 0.1),
                   net.input_delta_z_buffer)
    assert flat.shape == (4, 1)
    assert torch.equal(flat, net.input_delta_z_buffer.delta_mu)


def test_var_obs_of_a_full_batch_on_a_short_batch_is_refused_naming_the_shape():
    """pytagi's loops keep one var_obs array of the full batch size; the engine does not
    guess which part belongs to a short last batch (dptrain.pytagi takes the prefix, as pytagi
    reads it)."""
    net = _net(2)
    net(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"^var_obs has shape \(8,\), expected \(3, 1\) \(or "
                                         r"flat 3\) to match the last forward's batch of 3$"):
        OutputUpdater().update(net.output_z_buffer, np.zeros(3), np.full(8, 0.1),
                               net.input_delta_z_buffer)
    with pytest.raises(ValueError, match=r"^mu_obs has shape \(3, 3\), expected \(3, 1\)"):
        OutputUpdater().update(net.output_z_buffer, np.zeros((3, 3)), 0.1,
                               net.input_delta_z_buffer)
