"""AvgPool2d and MaxPool2d against oracles written element by element: AvgPool2d is a fixed
linear map (forward moments exact, Monte Carlo checked; innovations through its transpose);
MaxPool2d is a loop over the windows (the largest mean wins, innovations summed at the winner),
on windows of mixed signs and on windows whose means are all negative."""

from __future__ import annotations

import itertools

import pytest
import torch

from dptrain.tagi import AvgPool2d, Conv2d, HiddenStates, Linear, MaxPool2d, Sequential
from dptrain.tagi.states import DeltaStates
from tests.unit.tagi.helpers import F64, assert_close_mc, gen, monte_carlo, regression_step


def _windows(h: int, w: int, k: int, s: int, p: int, padding_type: int):
    """(output row, output col, [(input row, col) inside the image]) in raster order; pytagi's
    padding: type 1 shifts the windows up-left by p, type 2 pads right/bottom only."""
    total = 2 * p if padding_type == 1 else (p if padding_type == 2 else 0)
    shift = p if padding_type == 1 else 0
    ho, wo = (h - k + total) // s + 1, (w - k + total) // s + 1
    for r, c in itertools.product(range(ho), range(wo)):
        cells = [(r * s + i - shift, c * s + j - shift) for i in range(k) for j in range(k)]
        yield r, c, [(i, j) for i, j in cells if 0 <= i < h and 0 <= j < w]


def _avg_matrix(h: int, w: int, k: int, s: int, p: int, padding_type: int) -> torch.Tensor:
    """M (Ho·Wo, H·W) of one channel: 1/k² for every image pixel of a window."""
    rows = []
    for _, _, cells in _windows(h, w, k, s, p, padding_type):
        row = torch.zeros(h * w, dtype=F64)
        for i, j in cells:
            row[i * w + j] = 1.0 / (k * k)
        rows.append(row)
    return torch.stack(rows)


AVG_CASES = [  # kwargs, (h, w)
    (dict(kernel_size=2), (6, 4)),
    (dict(kernel_size=2, stride=-1), (4, 6)),
    (dict(kernel_size=3, stride=2, padding=1, padding_type=2), (6, 8)),  # pytagi's ResNet stem
    (dict(kernel_size=3, stride=1, padding=1, padding_type=1), (4, 5)),
    (dict(kernel_size=3, stride=2), (7, 5)),  # overlapping windows
    (dict(kernel_size=2, stride=2, padding=2, padding_type=1), (4, 4)),  # beyond torch's k/2
]


@pytest.mark.parametrize("kwargs,hw", AVG_CASES)
def test_avgpool_is_its_fixed_linear_map(kwargs, hw):
    """m = M m_A, v = M² v_A; δm_in = J ⊙ Mᵀ δm, δv_in = J² ⊙ (M²)ᵀ δv, per channel."""
    pool = AvgPool2d(**kwargs)
    k, s, p, t = pool.kernel_size, pool.stride, pool.padding, pool.padding_type
    h, w = hw
    m = _avg_matrix(h, w, k, s, p, t)
    g = gen(0)
    b, c = 2, 3
    mu = torch.randn(b, c, h, w, generator=g, dtype=F64)
    var = torch.rand(b, c, h, w, generator=g, dtype=F64)
    jcb = torch.rand(b, c, h, w, generator=g, dtype=F64)
    out = pool.forward(HiddenStates(mu, var, jcb))
    ho_wo = out.mu_a.shape[2] * out.mu_a.shape[3]
    assert ho_wo == m.shape[0]
    torch.testing.assert_close(out.mu_a.flatten(2), mu.flatten(2) @ m.T, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.var_a.flatten(2), var.flatten(2) @ (m * m).T, rtol=1e-12,
                               atol=1e-14)
    d_mu = torch.randn(out.mu_a.shape, generator=g, dtype=F64)
    d_var = -torch.rand(out.mu_a.shape, generator=g, dtype=F64)
    back = pool.backward(DeltaStates(d_mu, d_var), need_input_delta=True)
    torch.testing.assert_close(back.delta_mu.flatten(2), jcb.flatten(2) * (d_mu.flatten(2) @ m),
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(back.delta_var.flatten(2),
                               jcb.flatten(2) ** 2 * (d_var.flatten(2) @ (m * m)),
                               rtol=1e-12, atol=1e-14)


def test_avgpool_moments_match_monte_carlo():
    pool = AvgPool2d(3, stride=2, padding=1, padding_type=2)
    g = gen(1)
    mu = torch.randn(1, 2, 4, 4, generator=g, dtype=F64)
    var = 0.1 + torch.rand(1, 2, 4, 4, generator=g, dtype=F64)
    out = pool.forward(HiddenStates(mu, var))
    a = mu + var.sqrt() * torch.randn(100_000, 2, 4, 4, generator=g, dtype=F64)
    z = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(a, (0, 1, 0, 1)), 3, 2)
    mc = monte_carlo(z, z)
    assert_close_mc(out.mu_a[0], mc.mean, mc.mean_se, "AvgPool2d mean")
    assert_close_mc(out.var_a[0], mc.var, mc.var_se, "AvgPool2d variance")


def test_avgpool_stride_defaults_to_the_kernel():
    for stride in (None, -1):
        pool = AvgPool2d(2, stride=stride)
        assert pool.stride == 2
        out = pool.forward(HiddenStates(torch.zeros(1, 1, 6, 4), None))
        assert out.mu_a.shape == (1, 1, 3, 2) and out.var_a is None


def _max_pool_reference(mu, var, jcb, d_mu, d_var, k, s, p, t):
    """The rule of docs/tagi.md, MaxPool2d, as a loop: per window the largest mean among the
    image pixels wins (the first one in raster order on ties; `max` has no start value, so a
    window of negative means has a negative maximum); the output takes its mean and variance;
    backward adds J δ, J² δv at the winner. cuTAGI's loop differs only for means ≤ -1e9 (its
    start value; see docs/tagi.md, Departures from pytagi)."""
    b, c, h, w = mu.shape
    windows = list(_windows(h, w, k, s, p, t))
    ho = max(r for r, _, _ in windows) + 1
    wo = max(col for _, col, _ in windows) + 1
    out_mu = torch.zeros(b, c, ho, wo, dtype=F64)
    out_var = torch.zeros_like(out_mu)
    in_mu, in_var = torch.zeros_like(mu), torch.zeros_like(mu)
    for n, ch in itertools.product(range(b), range(c)):
        for r, col, cells in windows:
            winner = max(cells, key=lambda ij: float(mu[n, ch][ij]))  # the first maximum
            out_mu[n, ch, r, col] = mu[n, ch][winner]
            out_var[n, ch, r, col] = var[n, ch][winner]
            in_mu[n, ch][winner] += d_mu[n, ch, r, col] * jcb[n, ch][winner]
            in_var[n, ch][winner] += d_var[n, ch, r, col] * jcb[n, ch][winner] ** 2
    return out_mu, out_var, in_mu, in_var


MAX_CASES = [  # kwargs, (h, w)
    (dict(kernel_size=2), (4, 5)),  # pytagi's default stride 1: overlapping windows
    (dict(kernel_size=2, stride=2), (4, 6)),
    (dict(kernel_size=3, stride=2, padding=1, padding_type=1), (5, 7)),
    (dict(kernel_size=3, stride=2, padding=1, padding_type=2), (6, 4)),
    (dict(kernel_size=3, stride=1, padding=2, padding_type=1), (3, 3)),  # beyond torch's k/2
]


MAX_MEANS = {  # (low, high) of the integer means, and a shift
    "mixed signs": (-2, 3, 0.0),
    # Every window's maximum is negative: a max that starts at 0 (or padding that counts as 0)
    # would output 0 here, with no winner to route the innovations to.
    "all negative": (-4, 0, 0.0),
    # Below cuTAGI's start value -1e9, where its loop finds no winner at all (docs/tagi.md,
    # Departures from pytagi): the true maximum is still the rule.
    "below -1e9": (-4, 0, -1e10),
}


@pytest.mark.parametrize("means", list(MAX_MEANS))
@pytest.mark.parametrize("kwargs,hw", MAX_CASES)
def test_maxpool_is_the_largest_mean_of_each_window(kwargs, hw, means):
    """Outputs, variances and both input innovations equal the loop oracle to 1e-12, whatever
    the sign of the means. Mutations tried, each failing this test: padding the mean plane with
    0 instead of -inf in `MaxPool2d.forward` (a padded position wins every border window of
    negative means), and an oracle whose running maximum starts at 0 with a strict `>` (the
    rule the review attributed to cuTAGI; cuTAGI's own start value is -1e9)."""
    pool = MaxPool2d(**kwargs)
    g = gen(2)
    h, w = hw
    low, high, shift = MAX_MEANS[means]
    # Rounded means make ties common: the first maximum in raster order must win.
    mu = torch.randint(low, high, (2, 2, h, w), generator=g).to(F64) + shift
    var = torch.rand(2, 2, h, w, generator=g, dtype=F64)
    jcb = torch.rand(2, 2, h, w, generator=g, dtype=F64)
    out = pool.forward(HiddenStates(mu, var, jcb))
    d_mu = torch.randn(out.mu_a.shape, generator=g, dtype=F64)
    d_var = -torch.rand(out.mu_a.shape, generator=g, dtype=F64)
    back = pool.backward(DeltaStates(d_mu, d_var), need_input_delta=True)
    ref = _max_pool_reference(mu, var, jcb, d_mu, d_var, pool.kernel_size, pool.stride,
                              pool.padding, pool.padding_type)
    for got, want, what in zip((out.mu_a, out.var_a, back.delta_mu, back.delta_var), ref,
                               ("mean", "variance", "δm_in", "δv_in")):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=what)


def test_maxpool_of_a_deterministic_input_stays_deterministic():
    out = MaxPool2d(2).forward(HiddenStates(torch.randn(1, 1, 3, 3), None))
    assert out.mu_a.shape == (1, 1, 2, 2) and out.var_a is None


def test_pool_first_in_a_network_and_deltas_add_over_batch_splits():
    """A pool may come first (no input innovations needed); additivity holds through it."""
    net = Sequential(MaxPool2d(2, 2), Conv2d(1, 2, 2), AvgPool2d(2, 1), Linear(2, 2), dtype=F64)
    g = gen(3)
    x = torch.randn(6, 1, 6, 6, generator=g, dtype=F64)
    y = torch.randn(6, 2, generator=g, dtype=F64)
    regression_step(net, x, y, 0.4, do_step=False)
    whole = {k: v.clone() for k, v in net.named_delta_tensors()}
    parts = []
    for idx in (slice(0, 2), slice(2, 6)):
        regression_step(net, x[idx], y[idx], 0.4, do_step=False)
        parts.append({k: v.clone() for k, v in net.named_delta_tensors()})
    for name, value in whole.items():
        torch.testing.assert_close(value, parts[0][name] + parts[1][name], rtol=1e-10,
                                   atol=1e-14, msg=name)


@pytest.mark.parametrize("build,message", [
    (lambda: MaxPool2d(2, padding=2, padding_type=1),
     r"MaxPool2d: padding 2 must be smaller than the kernel 2"),
    (lambda: MaxPool2d(3, padding=1), r"MaxPool2d: padding=1 needs padding_type 1"),
    (lambda: AvgPool2d(3, stride=2, padding=1), r"AvgPool2d: padding=1 needs padding_type 1"),
    (lambda: AvgPool2d(0), r"AvgPool2d: kernel_size must be a positive int, got 0"),
    (lambda: AvgPool2d(2, stride=-2), r"AvgPool2d: stride must be a positive int, got -2"),
])
def test_construction_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_forward_errors_name_the_layer_and_the_shape():
    net = Sequential(Conv2d(1, 2, 3), AvgPool2d(2))
    with pytest.raises(ValueError, match=r"layer 1 \(AvgPool2d\(2, stride=2\)\): input height 5 "
                                         r"does not fit: \(input height − kernel \+ padding\) = 3"
                                         r" is not a multiple of the stride 2 \(input of "
                                         r"shape \(1, 2, 5, 5\)\)"):
        net(torch.zeros(1, 1, 7, 7))
    with pytest.raises(ValueError, match=r"layer 0 \(MaxPool2d\(2, stride=1\)\): expected an "
                                         r"image input \(batch, C, height, width\), got shape \(3, 16\)"):
        Sequential(MaxPool2d(2), Linear(9, 1))(torch.zeros(3, 16))
