"""Linear caches m_W² and m_W² + v_W per version of its parameters (linear.py): a stale cache
would give wrong moments silently, so every way the parameters change must be seen by the next
forward. The oracle is a fresh network loaded with the same parameters (it has no cache)."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import Linear, ReLU, Sequential, Sigmoid, manual_seed
from dptrain.tagi.states import DeltaStates, HiddenStates
from tests.unit.tagi.helpers import F64, gen, hrc_step


def _net(dtype: torch.dtype = F64) -> Sequential:
    manual_seed(0)
    return Sequential(Linear(6, 16), ReLU(), Linear(16, 16), ReLU(), Linear(16, 11), dtype=dtype)


def _x(dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(8, 6, generator=gen(1), dtype=dtype)


def _assert_fresh(net: Sequential) -> None:
    """net's evaluation forward equals that of a cache-free copy of its current parameters."""
    fresh = _net(net.dtype)
    fresh.load_state_dict(net.state_dict())
    net.eval()
    fresh.eval()
    got, want = net(_x(net.dtype)), fresh(_x(net.dtype))
    net.train()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _cached(net: Sequential) -> Sequential:
    """Fill the caches with an evaluation forward."""
    net.eval()
    net(_x(net.dtype))
    net.train()
    return net


def _step(net):
    hrc_step(net, _x(net.dtype), torch.arange(8) % 10)


def _load_other(net):
    other = _net()
    other.flat_params.mul_(1.5)
    net.load_state_dict(other.state_dict())


def _write_flat(net):
    net.flat_params[0, 6 * 16 + 16:].add_(0.25)  # every mean after the first layer


def _setitem_flat(net):
    net.flat_params[1] = net.flat_params[1] * 2.0


def _write_view(net):
    dict(net.named_parameter_tensors())["2.mu_w"].mul_(1.5)


def _write_variance_view(net):
    dict(net.named_parameter_tensors())["4.var_w"].add_(0.5)


def _write_numpy_then_clear(net):
    net.flat_params.numpy()[0, -20:] += 1.0  # bypasses torch's version counter: documented
    net.clear_cache()


@pytest.mark.parametrize("change", [_step, _load_other, _write_flat, _setitem_flat, _write_view,
                                    _write_variance_view, _write_numpy_then_clear])
def test_forward_sees_every_parameter_change(change):
    net = _cached(_net())
    change(net)
    _assert_fresh(net)


def test_cache_follows_to_and_backward_uses_the_forward_parameters():
    net = _cached(_net(torch.float32))
    net.to(F64)
    _assert_fresh(net)
    # A training step's backward pairs with its own forward's m_W², even if an evaluation
    # forward after a parameter write refreshed the cache in between.
    reference = _net()
    reference.load_state_dict(net.state_dict())
    for model in (net, reference):
        _step(model)
    _cached(net)
    assert torch.equal(net.flat_params, reference.flat_params)


def test_relu_mask_and_composed_jacobians():
    """After a ReLU alone J² = J, so δv is scaled once; after Sigmoid → ReLU J is not a mask and
    δv gets J² (docs/tagi.md, Linear)."""
    g = gen(2)
    z = HiddenStates(torch.randn(5, 3, generator=g, dtype=F64),
                     torch.rand(5, 3, generator=g, dtype=F64))
    d = DeltaStates(torch.randn(5, 2, generator=g, dtype=F64),
                    -torch.rand(5, 2, generator=g, dtype=F64))
    for acts in ((ReLU(),), (Sigmoid(), ReLU())):
        states = z
        for act in acts:
            states = act.forward(states)
        assert states.jcb_is_mask == (len(acts) == 1)
        manual_seed(3)
        layer = Linear(3, 2, dtype=F64)
        layer.forward(states)
        back = layer.backward(d, need_input_delta=True)
        jcb = states.jcb
        assert torch.equal(back.delta_mu, (d.delta_mu @ layer.mu_w) * jcb)
        torch.testing.assert_close(back.delta_var, (d.delta_var @ layer.mu_w**2) * jcb * jcb,
                                   rtol=1e-14, atol=0)
