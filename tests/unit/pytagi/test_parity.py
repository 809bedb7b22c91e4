"""Parity with the pytagi 0.2.1 wheel on the recorded cases of tests/data/pytagi_fixtures.npz
(harness: tests/unit/pytagi/parity.py): outputs, every layer's deltas and the parameters after
each of two training steps, and an eval forward, from pytagi's own initial parameters."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (AvgPool2d, Conv2d, Linear, MixtureReLU, ReLU, Sequential)
from tests.unit.pytagi.parity import load_case, replay

#: Every test here compares what this machine computes with pytagi's steps recorded on another
#: machine (tests/data), at a tolerance (RTOL) that its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

F64 = torch.float64


def _fnn(dtype):
    return Sequential(Linear(5, 6), ReLU(), Linear(6, 6), MixtureReLU(), Linear(6, 3),
                      dtype=dtype)


def _cnn(dtype):
    return Sequential(Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), ReLU(),
                      AvgPool2d(2, 2), Linear(27, 4), dtype=dtype)


def _cnn_stride_pad2(dtype):
    # padding_type 2: one pixel of padding on the right and bottom only; 6x6 -> 3x3 at stride 2.
    return Sequential(Conv2d(2, 4, 3, stride=2, padding=1, padding_type=2, in_width=6,
                             in_height=6), MixtureReLU(), Linear(36, 3), dtype=dtype)


BUILDERS = {"fnn": _fnn, "cnn": _cnn, "cnn_stride_pad2": _cnn_stride_pad2}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_float64_replay_matches_pytagi(name):
    replay(BUILDERS[name](F64), load_case(name)).assert_ok()


@pytest.mark.parametrize("name", ["cnn", "cnn_stride_pad2"])
def test_pytagi_flat_inputs_give_the_same_numbers(name):
    """pytagi's loops pass x.ravel(): a Conv2d-first network given in_width/in_height takes it."""
    replay(BUILDERS[name](F64), load_case(name), flat_inputs=True).assert_ok()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_float32_replay_matches_pytagi(name):
    """pytagi computes in float32 too; the summation orders differ, and the bound is the same
    1e-5 as in float64 (worst seen 3e-6 on these cases)."""
    replay(BUILDERS[name](torch.float32), load_case(name)).assert_ok()


def test_the_harness_notices_a_different_network():
    """A wrong layer (MixtureReLU where pytagi had ReLU) fails the replay, and naming exactly
    the failing comparisons as expected differences is what makes it pass."""
    wrong = Sequential(Linear(5, 6), MixtureReLU(), Linear(6, 6), MixtureReLU(), Linear(6, 3),
                       dtype=F64)
    result = replay(wrong, load_case("fnn"))
    assert "step0 out_mu" in result.failures and "step0 0.delta_mu_w" in result.failures
    with pytest.raises(AssertionError, match="comparisons differ from pytagi"):
        result.assert_ok()
    result.assert_ok(expected_failures=set(result.failures))
    with pytest.raises(AssertionError, match="expected to differ from pytagi but agree"):
        replay(_fnn(F64), load_case("fnn")).assert_ok(expected_failures={"step0 out_mu"})
