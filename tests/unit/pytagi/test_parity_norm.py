"""Parity with the pytagi 0.2.1 wheel for the normalisation layers and residual blocks
(tests/data/pytagi_fixtures.npz, harness tests/unit/pytagi/parity.py): outputs, every layer's
deltas and parameters after two training steps, the BatchNorm statistics (running and batch),
and an eval forward that uses the running statistics.

Two deliberate differences from pytagi are not exercised by these cases and are tested in
test_tagi_norm.py / test_tagi_blocks.py instead: a residual branch that ends in an activation
passes that activation's J to its innovations (cuTAGI drops it), and only a training forward
counts as the first batch of BatchNorm's running statistics (cuTAGI counts any forward)."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, LayerNorm, Linear, ReLU,
                          ResNetBlock, Sequential)
from tests.unit.pytagi.parity import RTOL, load_case, norm_statistics_hook, replay

#: Every test here compares what this machine computes with pytagi's steps recorded on another
#: machine (tests/data), at a tolerance (RTOL) that its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

F64 = torch.float64


def _fnn_bn(dtype):
    return Sequential(Linear(5, 6), BatchNorm2d(6), ReLU(), Linear(6, 3), dtype=dtype)


def _fnn_ln(dtype):
    return Sequential(Linear(5, 6), LayerNorm([6]), ReLU(), Linear(6, 3), dtype=dtype)


def _cnn_bn(dtype):
    return Sequential(Conv2d(2, 3, 3, padding=1, in_width=6, in_height=6), BatchNorm2d(3),
                      ReLU(), AvgPool2d(2, 2), Linear(27, 4), dtype=dtype)


def _resnet_identity(dtype):
    return Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=4, in_height=4), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 3, 3, padding=1), ReLU(), Conv2d(3, 3, 3, padding=1))),
        ReLU(), Linear(48, 2), dtype=dtype)


def _resnet_projection_bn(dtype):
    return Sequential(
        Conv2d(2, 3, 3, padding=1, in_width=4, in_height=4), BatchNorm2d(3), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(3, 4, 3, padding=1), BatchNorm2d(4), ReLU(),
                               Conv2d(4, 4, 3, padding=1), BatchNorm2d(4)),
                    LayerBlock(Conv2d(3, 4, 1), BatchNorm2d(4))),
        ReLU(), Linear(64, 2), dtype=dtype)


BUILDERS = {"fnn_bn": _fnn_bn, "fnn_ln": _fnn_ln, "cnn_bn": _cnn_bn,
            "resnet_identity": _resnet_identity, "resnet_projection_bn": _resnet_projection_bn}

#: pytagi's display name of each top-level layer holding BatchNorms -> our BatchNorm paths in
#: the order pytagi concatenates them (main block first, then the shortcut).
NORM_PATHS = {
    "fnn_bn": {"BatchNorm2d()_1": ["1"]},
    "cnn_bn": {"BatchNorm2d()_1": ["1"]},
    "resnet_projection_bn": {"BatchNorm2d()_1": ["1"],
                             "ResNetBlock(48,64)_3": ["3.main.1", "3.main.4", "3.short.1"]},
}


def _replay(name, dtype, rtol=RTOL):
    net = BUILDERS[name](dtype)
    hook = norm_statistics_hook(NORM_PATHS[name], rtol) if name in NORM_PATHS else None
    return replay(net, load_case(name), on_step=hook, rtol=rtol)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_float64_replay_matches_pytagi(name):
    """Includes the running statistics: the first training batch sets them to the batch
    statistics (pytagi's single-thread path, the one the fixtures record), the second blends
    them with momentum 0.9 on the old value; the eval forward normalises with them."""
    _replay(name, F64).assert_ok()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_float32_replay_matches_pytagi(name):
    _replay(name, torch.float32).assert_ok()


def test_running_statistics_are_state_keys_not_parameters():
    net = _resnet_projection_bn(F64)
    keys = set(net.state_dict())
    for path in ("1", "3.main.1", "3.main.4", "3.short.1"):
        assert {f"{path}.mu_ra", f"{path}.var_ra", f"{path}.num_batches_tracked"} <= keys
    assert not any(key.endswith("_ra") for key, _ in net.named_parameter_tensors())
