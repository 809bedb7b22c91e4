"""Parity with the pytagi 0.2.1 wheel for ConvTranspose2d, Softmax and ClosedFormSoftmax, on the
recorded cases of tests/data/pytagi_fixtures_layers.npz (harness: tests/unit/pytagi/parity.py;
recorder: tests/data/make_pytagi_fixtures.py, family "layers"): outputs, every delta and the
parameters after two training steps, and an eval forward, from pytagi's initial parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.tagi import (AvgPool2d, ClosedFormSoftmax, Conv2d, ConvTranspose2d, Linear,
                          MixtureReLU, OutputUpdater, ReLU, Sequential, Softmax, Tanh)
from tests.unit.pytagi.parity import FIXTURES, RTOL, Case, cap_report, load_case, replay

#: Every test here compares what this machine computes with pytagi's steps recorded on another
#: machine (tests/data), at a tolerance (RTOL) that its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

LAYER_FIXTURES = FIXTURES.with_name("pytagi_fixtures_layers.npz")
F64 = torch.float64
DTYPES = pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])


def _convT_autoencoder(dtype):
    return Sequential(Conv2d(1, 2, 3, padding=1, in_width=6, in_height=6), MixtureReLU(),
                      AvgPool2d(2, 2),
                      ConvTranspose2d(2, 3, 3, stride=2, padding=1, padding_type=2),
                      MixtureReLU(), ConvTranspose2d(3, 1, 3, padding=1), dtype=dtype)


def _convT_decoder(dtype):
    return Sequential(Linear(3, 2 * 2 * 2), Tanh(),
                      ConvTranspose2d(2, 3, 3, stride=2, padding=1, padding_type=2,
                                      in_width=2, in_height=2),
                      MixtureReLU(), ConvTranspose2d(3, 1, 3, bias=False, stride=2, padding=1),
                      dtype=dtype)


def _fnn_softmax(dtype, head=Softmax):
    return Sequential(Linear(4, 5), ReLU(), Linear(5, 3), head(), dtype=dtype)


def _fnn_cf_softmax(dtype):
    return Sequential(Linear(4, 6), MixtureReLU(), Linear(6, 3), ClosedFormSoftmax(),
                      dtype=dtype)


def _cnn_cf_softmax(dtype):
    return Sequential(Conv2d(1, 2, 3, padding=1, in_width=4, in_height=4), ReLU(),
                      AvgPool2d(2, 2), Linear(8, 3), ClosedFormSoftmax(), dtype=dtype)


BUILDERS = {"convT_autoencoder": _convT_autoencoder, "convT_decoder": _convT_decoder,
            "fnn_softmax_b3": _fnn_softmax, "fnn_cf_softmax": _fnn_cf_softmax,
            "cnn_cf_softmax": _cnn_cf_softmax}


def _flat_update(net: Sequential, case: Case, k: int) -> None:
    """pytagi's update with flat observations: the transposed convolutions' (B, 1, H, W)
    outputs take the recorded (B, H·W) pixels as pytagi's loops pass them, y.ravel()."""
    OutputUpdater(net.device).update(net.output_z_buffer, case[f"y{k}"].reshape(-1),
                                     case[f"var_y{k}"].reshape(-1), net.input_delta_z_buffer)


def _replay(name: str, dtype: torch.dtype, **kwargs):
    return replay(BUILDERS[name](dtype), load_case(name, LAYER_FIXTURES), update=_flat_update,
                  **kwargs)


@DTYPES
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_replay_matches_pytagi(name, dtype):
    """Every comparison within 1e-5 relative, in float64 and in float32."""
    result = _replay(name, dtype)
    result.assert_ok()
    assert result.largest_error()[0] <= RTOL


def test_the_transposed_convolution_cases_reach_the_cap_and_the_floor():
    """The autoencoder-like cases observe every pixel, so their steps are large: from pytagi's
    recorded numbers, the cap bounds mean and variance changes and the floor resets variances
    of both transposed layers' groups; no decreasing variance sits within 0.5 % of the floor's
    threshold, so both precisions take pytagi's branch. The decoder reads a Linear's flat
    output as 2x2 images (in_width/in_height)."""
    for name in ("convT_autoencoder", "convT_decoder"):
        report = cap_report(load_case(name, LAYER_FIXTURES))
        assert report.mean_ratio > 10 and report.var_ratio > 1, (name, report)
        assert report.floors > 0 and report.ties == 0 and report.margin > 5e-3, (name, report)
    decoder = load_case("convT_decoder", LAYER_FIXTURES)
    assert decoder["x0"].shape == (16, 3) and decoder["step0/out_mu"].size == 16 * 7 * 7


def test_autoencoder_case_takes_pytagi_flat_inputs():
    """A network starting with a Conv2d given in_width/in_height takes x.ravel()."""
    _replay("convT_autoencoder", F64, flat_inputs=True).assert_ok()


class _WheelCpuSoftmax(Softmax):
    """What pytagi 0.2.1's CPU Softmax computes (docs/tagi.md, Departures from pytagi): our
    per-sample formula applied to groups of B consecutive values of the flat (B·N) batch."""

    def moments(self, mu_z, var_z):
        batch = mu_z.shape[0]
        groups = [t.reshape(-1, batch) for t in (mu_z, var_z)]
        return tuple(t.reshape(mu_z.shape) for t in super().moments(*groups))


def test_softmax_of_each_sample_where_pytagi_groups_b_consecutive_values():
    """The deliberate difference. With B = N the wheel's groups are the samples and
    fnn_softmax_b3 agrees everywhere (test_replay_matches_pytagi); with B = 4 and N = 3
    (fnn_softmax) it differs from the first output on. Replaying that case with the wheel's
    grouping swapped in reproduces every recorded number, so the grouping is the whole
    difference; the wheel's rows do not sum to 1, ours do."""
    case = load_case("fnn_softmax", LAYER_FIXTURES)
    assert case["x0"].shape[0] == 4 and case["step0/out_mu"].size == 4 * 3
    assert load_case("fnn_softmax_b3", LAYER_FIXTURES)["x0"].shape[0] == 3
    ours = replay(_fnn_softmax(F64), case, update=_flat_update)
    assert {"step0 out_mu", "step0 out_var", "step0 2.delta_mu_w"} <= set(ours.failures)
    replay(_fnn_softmax(F64, head=_WheelCpuSoftmax), case, update=_flat_update).assert_ok()
    wheel_sums = case["step0/out_mu"].reshape(4, 3).sum(1)
    assert np.abs(wheel_sums - 1).max() > 0.1
    net = _fnn_softmax(F64)
    mu, _ = net(case["x0"])
    torch.testing.assert_close(mu.sum(1), torch.ones(4, dtype=F64))
