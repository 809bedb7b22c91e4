"""Parity of the LSTM layer with the pytagi 0.2.1 wheel on the recorded cases of
tests/data/pytagi_fixtures_lstm.npz (harness: tests/unit/pytagi/parity.py): two stacked LSTMs
and a Linear head over every time step's hidden state; outputs, every layer's deltas and the
parameters after each of two training steps, and an eval forward, from pytagi's own initial
parameters. lstm_online (batch 1, seq_len 1) carries hidden and cell states from call to call,
with backward replacing them by their posteriors, so its second step and the eval forward
only agree if the carried states do."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import LSTM, Linear, Sequential
from tests.unit.pytagi.parity import LSTM_FIXTURES, load_case, replay

#: Every test here compares what this machine computes with pytagi's steps recorded on another
#: machine (tests/data), at a tolerance (RTOL) that its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

F64 = torch.float64


def _stack(dtype):
    return Sequential(LSTM(1, 4, 3), LSTM(4, 4, 3), Linear(4 * 3, 1), dtype=dtype)


def _features(dtype):
    return Sequential(LSTM(2, 3, 4), LSTM(3, 3, 4, bias=False), Linear(3 * 4, 2), dtype=dtype)


def _online(dtype):
    return Sequential(LSTM(3, 4, 1), LSTM(4, 4, 1), Linear(4, 1), dtype=dtype)


BUILDERS = {"lstm_stack": _stack, "lstm_features": _features, "lstm_online": _online}


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_replay_matches_pytagi(name, dtype):
    replay(BUILDERS[name](dtype), load_case(name, LSTM_FIXTURES)).assert_ok()


@pytest.mark.parametrize("name", ["lstm_stack", "lstm_features"])
def test_pytagi_flat_inputs_give_the_same_numbers(name):
    """pytagi's loops pass x.ravel() of (B, T, D) windows; a network starting with an LSTM
    takes that flat array (and (B, T·D)) as well as (B, T, D)."""
    replay(BUILDERS[name](F64), load_case(name, LSTM_FIXTURES), flat_inputs=True).assert_ok()


def test_online_case_depends_on_the_carried_states():
    """Without the carried states (reset before every forward) the online case's second step
    differs from pytagi: the fixture does test the carry."""
    net = _online(F64)
    layers = [net.layers[0], net.layers[1]]
    original = LSTM.forward

    def forgetful(self, states):
        self.reset_lstm_states()
        return original(self, states)

    for layer in layers:
        layer.forward = forgetful.__get__(layer)
    result = replay(net, load_case("lstm_online", LSTM_FIXTURES))
    assert "step1 out_mu" in result.failures and "eval out_mu" in result.failures
    assert "step0 out_mu" not in result.failures
