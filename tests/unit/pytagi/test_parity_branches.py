"""Parity with the pytagi 0.2.1 wheel on the recorded cases that reach what the first ones
cannot (tests/data/pytagi_fixtures.npz, harness tests/unit/pytagi/parity.py).

The cases of test_tagi_parity.py and test_tagi_parity_norm.py run at batch 4 (one cap factor),
never bind the variance cap (largest |Δv| / bar 0.55), never fire the variance floor, and feed
every Conv2d, pooling, BatchNorm, LayerNorm and shortcut a J of 1 or a ReLU mask, for which
J = J² and a dropped J often changes nothing. These cases add, each checked below to still do
so (a re-recorded fixture that stopped covering something fails here, not silently):

- fnn_cap_b16, fnn_cap_b256: batches 16 and 256 (cap factors 2 and 3) with the mean and the
  variance cap binding and the floor firing (small observation noise, gains up to 2);
- cnn_mixture_bn: MixtureReLU into a Conv2d, MixtureTanh into BatchNorm2d, MixtureReLU into
  AvgPool2d, a Conv2d without bias;
- cnn_maxpool_1ch: a first Conv2d on one deterministic channel (the unfolded path), Tanh and
  MixtureReLU into MaxPool2d with overlapping windows (3/2 and 2/1), no bias in Conv2d and Linear;
- cnn_ln: LayerNorm on images right after a Conv2d and after MixtureTanh, without bias;
- resnet_mixture_bn: tagi-resnet18's order (conv without bias, MixtureReLU, BatchNorm), an
  identity block fed by MixtureReLU and a projection block (stride 2, padding_type 2) fed by
  MixtureTanh, so a smooth J enters both kinds of shortcut; the cap binds and the floor fires,
  twice at exactly v = bar (v = 1/4, c = 2), where the rule "≤ 0" floors.
"""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, LayerNorm, Linear, MaxPool2d,
                          MixtureReLU, MixtureTanh, ResNetBlock, Sequential, Tanh)
from dptrain.tagi.norm import _Norm
from dptrain.tagi.pooling import _Pool2d
from tests.unit.pytagi.parity import (RTOL, cap_report, layer_at, load_case, norm_statistics_hook,
                                      replay)

#: Every test here compares what this machine computes with pytagi's steps recorded on another
#: machine (tests/data), at a tolerance (RTOL) that its kernels cannot break: docs/design.md,
#: contract 12.
pytestmark = pytest.mark.recorded

F64 = torch.float64


def _fnn_cap_b16(dtype):
    return Sequential(Linear(4, 8, gain_weight=2.0, gain_bias=2.0), MixtureTanh(),
                      Linear(8, 8, bias=False, gain_weight=0.6), Tanh(),
                      Linear(8, 2, gain_bias=1.2), dtype=dtype)


def _fnn_cap_b256(dtype):
    return Sequential(Linear(3, 6, gain_weight=2.0, gain_bias=2.0), MixtureReLU(),
                      Linear(6, 2), dtype=dtype)


def _cnn_mixture_bn(dtype):
    return Sequential(Conv2d(2, 4, 3, padding=1, in_width=6, in_height=6), MixtureReLU(),
                      Conv2d(4, 4, 3, padding=1, bias=False), MixtureTanh(), BatchNorm2d(4),
                      MixtureReLU(), AvgPool2d(2, 2), Linear(36, 3), dtype=dtype)


def _cnn_maxpool_1ch(dtype):
    return Sequential(Conv2d(1, 4, 3, bias=False, padding=1, in_width=7, in_height=7), Tanh(),
                      MaxPool2d(3, 2), Conv2d(4, 4, 2, padding=1), MixtureReLU(),
                      MaxPool2d(2, 1), Linear(36, 3, bias=False), dtype=dtype)


def _cnn_ln(dtype):
    return Sequential(Conv2d(2, 3, 3, padding=1, in_width=5, in_height=5), LayerNorm([3, 5, 5]),
                      MixtureReLU(), Conv2d(3, 3, 3, padding=1, bias=False), MixtureTanh(),
                      LayerNorm([3, 5, 5], bias=False), Linear(75, 2), dtype=dtype)


def _resnet_mixture_bn(dtype):
    def main(c_in, c_out, stride, padding_type):
        return LayerBlock(Conv2d(c_in, c_out, 3, stride=stride, padding=1,
                                 padding_type=padding_type, bias=False),
                          MixtureReLU(), BatchNorm2d(c_out),
                          Conv2d(c_out, c_out, 3, padding=1, bias=False), MixtureReLU(),
                          BatchNorm2d(c_out))

    return Sequential(
        Conv2d(2, 3, 3, padding=1, bias=False, in_width=4, in_height=4), BatchNorm2d(3),
        MixtureReLU(), ResNetBlock(main(3, 3, 1, 1)), MixtureTanh(),
        ResNetBlock(main(3, 4, 2, 2), LayerBlock(Conv2d(3, 4, 2, stride=2, bias=False),
                                                 BatchNorm2d(4))),
        AvgPool2d(2), Linear(4, 2), dtype=dtype)


BUILDERS = {"fnn_cap_b16": _fnn_cap_b16, "fnn_cap_b256": _fnn_cap_b256,
            "cnn_mixture_bn": _cnn_mixture_bn, "cnn_maxpool_1ch": _cnn_maxpool_1ch,
            "cnn_ln": _cnn_ln, "resnet_mixture_bn": _resnet_mixture_bn}

NORM_PATHS = {
    "cnn_mixture_bn": {"BatchNorm2d()_4": ["4"]},
    "resnet_mixture_bn": {"BatchNorm2d()_1": ["1"],
                          "ResNetBlock(48,48)_3": ["3.main.2", "3.main.5"],
                          "ResNetBlock(48,16)_5": ["5.main.2", "5.main.5", "5.short.1"]},
}

#: The one comparison where the wheel's float32 arithmetic is further than 1e-5 from ours:
#: BatchNorm's Δm_γ of the last block, Σ x̂ δm over 64 values that nearly cancel, summed in
#: float32 one term after the other by the wheel. Measured: 1.1e-5 (our float64), 1.4e-5 (our
#: float32); our own float32 differs from our float64 on it by 4e-6. Every other comparison of
#: every case is within RTOL.
LOOSER = {"resnet_mixture_bn": {"step1 5.main.5.delta_mu_w": 2e-5}}


def _replay(name, dtype):
    hook = norm_statistics_hook(NORM_PATHS[name]) if name in NORM_PATHS else None
    return replay(BUILDERS[name](dtype), load_case(name), on_step=hook,
                  looser=LOOSER.get(name))


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_replay_matches_pytagi(name, dtype):
    """Outputs, every delta, the parameters after both steps, BatchNorm statistics and the eval
    forward, within 1e-5 relative in float64 and in float32 (the named exception: LOOSER)."""
    result = _replay(name, dtype)
    result.assert_ok()
    assert result.largest_error(exclude=LOOSER.get(name, {}))[0] <= RTOL


def test_the_looser_bound_is_needed_and_nothing_else_is():
    """The exception in LOOSER is real (the comparison exceeds RTOL in both precisions), so it
    must not be silently widened to other entries or kept after a fix."""
    for dtype in (F64, torch.float32):
        result = _replay("resnet_mixture_bn", dtype)
        error, what = result.largest_error()
        assert what in LOOSER["resnet_mixture_bn"] and RTOL < error <= 2e-5, (dtype, what, error)


def test_the_cap_binds_and_the_floor_fires_at_two_cap_factors():
    """From pytagi's recorded numbers alone: the cap bounds some mean and some variance change
    by a clear margin, the floor resets variances (each stored as 1e-5), and no decreasing
    variance sits within 1 % of the floor's threshold except exact ties, so the float32 and
    float64 replays take the same branch as pytagi."""
    reports = {name: cap_report(load_case(name))
               for name in ("fnn_cap_b16", "fnn_cap_b256", "resnet_mixture_bn")}
    assert {r.factor for r in reports.values()} == {2.0, 3.0}
    for name, report in reports.items():
        assert report.mean_ratio > 2 and report.var_ratio > 1.5, (name, report)
        assert report.floors >= 2 and report.margin > 0.01, (name, report)
    assert reports["resnet_mixture_bn"].ties == 2  # v = bar exactly, floored by "≤ 0"
    assert load_case("fnn_cap_b256")["x0"].shape[0] == 256


def _entering_jacobians(net: Sequential) -> dict[str, list[torch.Tensor]]:
    """The J each Conv2d, pool, norm and shortcut stored for its input in the last training
    forward, by kind (private attributes: what the backward will multiply by)."""
    found: dict[str, list[torch.Tensor]] = {}

    def add(kind: str, jcb: torch.Tensor | None) -> None:
        if jcb is not None:
            found.setdefault(kind, []).append(jcb)

    for layer in net.descendants():
        if isinstance(layer, ResNetBlock):
            if layer.short is None:
                add("identity shortcut", layer._jcb_short)
            else:
                add("projection shortcut", layer.short.layers[0]._jcb)
        elif isinstance(layer, (Conv2d, _Pool2d, _Norm)):
            add(type(layer).__name__, layer._jcb)
    return found


def test_smooth_jacobians_enter_every_layer_kind_that_multiplies_by_them():
    """A J strictly between 0 and 1 on many elements (so J ≠ J², and dropping it changes the
    numbers) enters every Conv2d-like, pooling, norm and shortcut kind across the cases."""
    smooth: set[str] = set()
    for name in BUILDERS:
        net = BUILDERS[name](F64)
        net(load_case(name)["x0"])
        for kind, jcbs in _entering_jacobians(net).items():
            for jcb in jcbs:
                inside = ((jcb > 0.05) & (jcb < 0.95)).double().mean().item()
                if inside > 0.25:
                    smooth.add(kind)
    assert smooth >= {"Conv2d", "AvgPool2d", "MaxPool2d", "BatchNorm2d", "LayerNorm",
                      "identity shortcut", "projection shortcut"}, smooth


def test_the_first_conv_takes_the_one_channel_path_and_max_pool_windows_share_inputs():
    net = _cnn_maxpool_1ch(F64)
    net(load_case("cnn_maxpool_1ch")["x0"])
    first = layer_at(net, "0")
    assert first._patches is not None  # the matrix-product path for one deterministic channel
    for path in ("2", "5"):
        pool = layer_at(net, path)
        assert pool.kernel_size > pool.stride
        winners = pool._argmax  # (B, C, Ho·Wo) index of each window's maximum
        repeated = winners.sort(dim=2).values.diff(dim=2).eq(0).any(dim=2)
        assert repeated.any(), f"no input wins two overlapping windows of layer {path}"
