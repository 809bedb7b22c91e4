"""Conv2d against oracles: Monte Carlo forward moments and covariances (which the innovations
are made of), the same layer written as a Linear on unfolded patches (im2col) in forward,
backward and deltas, init, the flat inputs of pytagi's loops, batch additivity, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dptrain.tagi import (AvgPool2d, Conv2d, HiddenStates, Linear, MaxPool2d, MixtureReLU, ReLU,
                          Sequential, manual_seed)
from dptrain.tagi.states import DeltaStates
from tests.unit.tagi.helpers import (F64, assert_close_mc, deltas, gen, monte_carlo,
                                     regression_step, spread_conv)


def _conv(seed: int, c: int, o: int, k: int, **kwargs) -> Conv2d:
    return spread_conv(Conv2d, seed, c, o, k, **kwargs)


def _sample_conv(layer: Conv2d, mu_a: torch.Tensor, var_a: torch.Tensor, n: int,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n joint draws (A, Z) of one input sample (1, C, H, W) through random W, B."""
    w = layer.mu_w + layer.var_w.sqrt() * torch.randn((n,) + layer.mu_w.shape, generator=g,
                                                      dtype=F64)
    b = layer.mu_b + layer.var_b.sqrt() * torch.randn(n, layer.out_channels, generator=g,
                                                      dtype=F64)
    a = mu_a + var_a.sqrt() * torch.randn((n,) + mu_a.shape[1:], generator=g, dtype=F64)
    # n samples as groups of one grouped convolution: sample i uses its own weights w[i].
    s, p = layer.window.stride, layer.window.native_padding
    z = F.conv2d(layer.window.pad(a.reshape(1, -1, *a.shape[2:])),
                 w.reshape(-1, *w.shape[2:]), b.reshape(-1), s, p, groups=n)
    return a, z.reshape(n, layer.out_channels, *z.shape[2:])


@pytest.mark.parametrize("kwargs", [dict(padding=1), dict(stride=2, padding=1, padding_type=2)])
def test_forward_moments_match_monte_carlo(kwargs):
    """m_Z, v_Z are the exact mean and variance of W ⋆ A + B for independent Gaussians."""
    layer = _conv(0, 2, 2, 3, **kwargs)
    g = gen(1)
    mu_a = torch.randn(1, 2, 4, 4, generator=g, dtype=F64)
    var_a = 0.1 + 0.5 * torch.rand(1, 2, 4, 4, generator=g, dtype=F64)
    out = layer.forward(HiddenStates(mu_a, var_a))
    _, z = _sample_conv(layer, mu_a, var_a, 100_000, g)
    mc = monte_carlo(z, z)
    assert_close_mc(out.mu_a[0], mc.mean, mc.mean_se, "Conv2d m_Z")
    assert_close_mc(out.var_a[0], mc.var, mc.var_se, "Conv2d v_Z")
    assert out.jcb is None


def test_innovations_are_the_monte_carlo_covariances():
    """One output unit observed per sample: the innovations for the input are Cov(A, Z_i)/v_A
    (δm) and −(Cov(A, Z_i)/v_A)² (δv for δv_Z = −1), the definition of TAGI's backward pass."""
    layer = _conv(2, 2, 2, 3, stride=2, padding=1)
    g = gen(3)
    mu_a = torch.randn(1, 2, 5, 5, generator=g, dtype=F64)
    var_a = 0.2 + 0.5 * torch.rand(1, 2, 5, 5, generator=g, dtype=F64)
    out_shape = layer.forward(HiddenStates(mu_a, var_a)).mu_a.shape[1:]  # (O, Ho, Wo)
    units = math.prod(out_shape)
    # Batch row i observes output unit i alone (a unit innovation).
    batch_mu = mu_a.expand(units, -1, -1, -1).contiguous()
    batch_var = var_a.expand(units, -1, -1, -1).contiguous()
    layer.forward(HiddenStates(batch_mu, batch_var))
    eye = torch.eye(units, dtype=F64).view(units, *out_shape)
    back = layer.backward(DeltaStates(eye, -eye), need_input_delta=True)
    a, z = _sample_conv(layer, mu_a, var_a, 50_000, g)
    a_dev = (a - a.mean(0)).flatten(1)  # (n, C·H·W)
    z_dev = (z - z.mean(0)).flatten(1)  # (n, units)
    prods = z_dev[:, :, None] * a_dev[:, None, :]  # (n, units, C·H·W)
    cov, cov_se = prods.mean(0), prods.std(0) / prods.shape[0] ** 0.5
    v = var_a.flatten()
    assert_close_mc(back.delta_mu.flatten(1) * v, cov, cov_se, "Cov(A, Z) from δm")
    assert_close_mc((-back.delta_var).sqrt().flatten(1) * v, cov.abs(), cov_se,
                    "|Cov(A, Z)| from δv")


def _im2col_linear(conv: Conv2d) -> Linear:
    """The Linear (O, C·k·k) that maps one unfolded patch to the O outputs at its position."""
    lin = Linear(conv.in_channels * conv.kernel_size ** 2, conv.out_channels, bias=conv.bias,
                 dtype=F64)
    for name, tensor in conv.named_parameter_tensors():
        getattr(lin, name).copy_(tensor.reshape(getattr(lin, name).shape))
    return lin


def _patches(conv: Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B·L, C·k·k) rows of unfolded windows (zero padding of either type)."""
    w = conv.window
    cols = F.unfold(w.pad(x), conv.kernel_size, padding=w.native_padding, stride=w.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


@pytest.mark.parametrize("kwargs,h,w", [
    (dict(), 6, 5),
    (dict(padding=1), 5, 6),
    (dict(stride=2, padding=1), 7, 9),
    (dict(stride=2, padding=1, padding_type=2), 6, 8),
    (dict(stride=3, padding=2, padding_type=2, bias=False), 7, 10),
    (dict(stride=2, padding=2), 7, 5),
])
def test_conv_equals_linear_on_unfolded_patches(kwargs, h, w):
    """Forward moments, input innovations (through J) and all four deltas of Conv2d equal a
    Linear applied to the im2col patches, to 1e-10 (non-square images included)."""
    conv = _conv(4, 2, 3, 3, **kwargs)
    lin = _im2col_linear(conv)
    g = gen(5)
    b, c = 3, 2
    mu_a = torch.randn(b, c, h, w, generator=g, dtype=F64)
    var_a = torch.rand(b, c, h, w, generator=g, dtype=F64)
    jcb = torch.rand(b, c, h, w, generator=g, dtype=F64)
    out = conv.forward(HiddenStates(mu_a, var_a, jcb))
    ho, wo = out.mu_a.shape[2:]
    ref = lin.forward(HiddenStates(_patches(conv, mu_a), _patches(conv, var_a),
                                   _patches(conv, jcb)))
    as_image = lambda rows: rows.view(b, ho * wo, -1).transpose(1, 2).reshape(b, -1, ho, wo)  # noqa: E731
    torch.testing.assert_close(out.mu_a, as_image(ref.mu_a), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.var_a, as_image(ref.var_a), rtol=1e-10, atol=1e-12)

    d_mu = torch.randn(out.mu_a.shape, generator=g, dtype=F64)
    d_var = -torch.rand(out.mu_a.shape, generator=g, dtype=F64)
    back = conv.backward(DeltaStates(d_mu, d_var), need_input_delta=True)
    conv.scale_deltas_()
    as_rows = lambda img: img.flatten(2).transpose(1, 2).reshape(-1, img.shape[1])  # noqa: E731
    ref_back = lin.backward(DeltaStates(as_rows(d_mu), as_rows(d_var)), need_input_delta=True)
    lin.scale_deltas_()
    # Fold the patch innovations back onto the image: each input sums over its windows.
    win = conv.window
    padded_hw = (h + win.padding, w + win.padding) if win.pads_explicitly else (h, w)

    def fold(rows: torch.Tensor) -> torch.Tensor:
        cols = rows.view(b, ho * wo, -1).transpose(1, 2)
        img = F.fold(cols, padded_hw, conv.kernel_size, padding=win.native_padding,
                     stride=win.stride)
        return img[:, :, :h, :w]

    torch.testing.assert_close(back.delta_mu, fold(ref_back.delta_mu), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(back.delta_var, fold(ref_back.delta_var), rtol=1e-10,
                               atol=1e-12)
    for (name, got), (_, want) in zip(conv.named_delta_tensors(), lin.named_delta_tensors()):
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-10, atol=1e-12,
                                   msg=name)


@pytest.mark.parametrize("kwargs", [
    dict(padding=1), dict(stride=2, padding=1, padding_type=2, bias=False),
    dict(stride=3, padding=2),
])
def test_one_channel_first_layer_as_matmuls_equals_the_convolutions(kwargs):
    """A deterministic 1-channel input takes the unfolded-patches path (`_forward_unfolded`);
    the same input with an explicit zero variance takes the convolution path. Outputs (in
    channels-last layout), input innovations and all deltas agree to float64 rounding."""
    g = gen(8)
    mu_a = torch.randn(3, 1, 8, 14, generator=g, dtype=F64)
    jcb = torch.rand(3, 1, 8, 14, generator=g, dtype=F64)
    results = []
    for var_a in (None, torch.zeros_like(mu_a)):
        conv = _conv(9, 1, 4, 3, **kwargs)
        out = conv.forward(HiddenStates(mu_a, var_a, jcb))
        assert (conv._patches is not None) == (var_a is None)  # both paths really ran
        assert out.mu_a.is_contiguous(memory_format=torch.channels_last)
        gd = gen(10)
        d_mu = torch.randn(out.mu_a.shape, generator=gd, dtype=F64)
        d_var = -torch.rand(out.mu_a.shape, generator=gd, dtype=F64)
        back = conv.backward(DeltaStates(d_mu, d_var), need_input_delta=True)
        conv.scale_deltas_()
        results.append([out.mu_a, out.var_a, back.delta_mu, back.delta_var,
                        *(t.clone() for _, t in conv.named_delta_tensors())])
        assert conv.backward(DeltaStates(d_mu, d_var), need_input_delta=False) is None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_uncertain_input_after_a_deterministic_one_uses_its_own_windows():
    """Bug pinned: a 1-channel Conv2d keeps the unfolded patches of a deterministic input for
    its weight deltas; a later training forward on an *uncertain* input (the convolution path)
    must drop them. Were they kept, the next backward would take the patches path and compute
    Δ_W from the previous batch's windows: same shapes, no error, wrong deltas. Mutation tried:
    deleting `self._patches = self._patches_sq = None` from `Conv2d.forward`; this test then
    fails (the rest of the conv and parity tests pass with it)."""
    g = gen(12)
    first = torch.randn(2, 1, 6, 6, generator=g, dtype=F64)
    mu_a = torch.randn(2, 1, 6, 6, generator=g, dtype=F64)
    var_a = 0.1 + torch.rand(2, 1, 6, 6, generator=g, dtype=F64)
    d_mu = torch.randn(2, 3, 6, 6, generator=g, dtype=F64)
    d_var = -torch.rand(2, 3, 6, 6, generator=g, dtype=F64)
    results = []
    for history in ([first], []):  # trained on `first` before, or fresh (the reference)
        conv = _conv(13, 1, 3, 3, padding=1)
        for x in history:
            conv.forward(HiddenStates(x, None))
            conv.backward(DeltaStates(d_mu, d_var), need_input_delta=False)
        conv.forward(HiddenStates(mu_a, var_a))
        back = conv.backward(DeltaStates(d_mu, d_var), need_input_delta=True)
        conv.scale_deltas_()
        results.append([back.delta_mu, back.delta_var,
                        *(t.clone() for _, t in conv.named_delta_tensors())])
    names = ["δm_in", "δv_in"] + [n for n, _ in conv.named_delta_tensors()]
    for name, got, want in zip(names, *results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
    # The reference itself is the convolution's weight gradient of this input (not the first).
    torch.testing.assert_close(
        results[1][2], conv.var_w * torch.nn.grad.conv2d_weight(mu_a, conv.mu_w.shape, d_mu,
                                                                padding=1),
        rtol=1e-12, atol=1e-12)


def test_image_states_are_channels_last_and_layout_does_not_matter():
    """Conv and pooling layers hand on channels-last states; an NCHW and a channels-last
    input give the same outputs and deltas (float64), a Linear after them flattens C-major."""
    def run(x: torch.Tensor) -> list[torch.Tensor]:
        manual_seed(3)
        net = Sequential(Conv2d(2, 4, 3, padding=1), ReLU(), AvgPool2d(3, 2),
                         Conv2d(4, 3, 2), MixtureReLU(), Linear(3 * 2 * 2, 2), dtype=F64)
        states = net.layers[0].forward(HiddenStates(x, None))
        assert states.mu_a.is_contiguous(memory_format=torch.channels_last)
        mu, var = net(x)
        regression_step(net, x, torch.ones(x.shape[0], 2), 0.1, do_step=False)
        return [mu, var, *deltas(net).values()]

    x = torch.randn(3, 2, 7, 7, generator=gen(11), dtype=F64)
    for got, want in zip(run(x), run(x.contiguous(memory_format=torch.channels_last))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _sum_pool_conv(padding_type: int, size: int) -> torch.Tensor:
    """A 2x2 all-ones kernel at stride 2 with one pixel of padding on an arange image."""
    conv = Conv2d(1, 1, 2, bias=False, stride=2, padding=1, padding_type=padding_type,
                  dtype=F64)
    conv.mu_w.fill_(1.0)
    x = torch.arange(size * size, dtype=F64).view(1, 1, size, size)
    return conv.forward(HiddenStates(x, None)).mu_a[0, 0]


def test_padding_type_2_pads_right_and_bottom_only():
    """Type 2 keeps the image at the top-left: on 3x3 the windows are rows/cols {0,1}, {2,pad}.
    Type 1 pads every side: on 4x4 the first window holds only pixel (0, 0)."""
    assert _sum_pool_conv(2, 3).tolist() == [[0 + 1 + 3 + 4, 2 + 5], [6 + 7, 8]]
    assert _sum_pool_conv(1, 4).tolist() == [[0, 1 + 2, 3], [4 + 8, 5 + 6 + 9 + 10, 7 + 11],
                                             [12, 13 + 14, 15]]


@pytest.mark.parametrize("method,gain", [("He", 1.0), ("Xavier", 0.5)])
def test_init_uses_the_fan_of_the_kernel(method, gain):
    """s = sqrt(1/(C k²)) (He) or sqrt(2/((C + O) k²)) (Xavier); v = (gain s)²."""
    manual_seed(0)
    conv = Conv2d(16, 32, 5, gain_weight=gain, gain_bias=2 * gain, init_method=method)
    s = math.sqrt(1 / (16 * 25)) if method == "He" else math.sqrt(2 / (48 * 25))
    assert conv.mu_w.shape == (32, 16, 5, 5)
    assert conv.mu_w.std().item() == pytest.approx(s, rel=0.03)
    torch.testing.assert_close(conv.var_w, torch.full((32, 16, 5, 5), (gain * s) ** 2))
    torch.testing.assert_close(conv.var_b, torch.full((32,), (2 * gain * s) ** 2))


def test_linear_after_conv_flattens_like_torch():
    """A Linear on (B, C, H, W) states equals the Linear on torch.flatten(states, 1), and the
    innovations come back in the image shape."""
    manual_seed(1)
    lin = Linear(2 * 3 * 3, 4, dtype=F64)
    g = gen(2)
    mu = torch.randn(5, 2, 3, 3, generator=g, dtype=F64)
    var = torch.rand(5, 2, 3, 3, generator=g, dtype=F64)
    jcb = torch.rand(5, 2, 3, 3, generator=g, dtype=F64)
    out = lin.forward(HiddenStates(mu, var, jcb))
    ref = F.linear(torch.nn.Flatten()(mu), lin.mu_w, lin.mu_b)
    torch.testing.assert_close(out.mu_a, ref, rtol=1e-13, atol=1e-14)
    d = torch.randn(5, 4, generator=g, dtype=F64)
    back = lin.backward(DeltaStates(d, -d.abs()), need_input_delta=True)
    assert back.delta_mu.shape == (5, 2, 3, 3)
    torch.testing.assert_close(back.delta_mu, (jcb.flatten(1) * (d @ lin.mu_w)).view(5, 2, 3, 3))


def _conv_net(dtype=F64) -> Sequential:
    manual_seed(3)
    return Sequential(Conv2d(2, 4, 3, padding=1, in_width=6, in_height=6), ReLU(),
                      AvgPool2d(2), Conv2d(4, 4, 2, stride=1, padding=1, padding_type=2),
                      MixtureReLU(), MaxPool2d(2, stride=1), Linear(16, 3), dtype=dtype)


def test_flat_inputs_of_pytagi_loops():
    """(B, C·H·W) and (B·C·H·W,) are reshaped C-major to (B, C, H, W): same outputs."""
    net = _conv_net()
    x = torch.randn(4, 2, 6, 6, generator=gen(4), dtype=F64)
    mu, var = net(x)
    for flat in (x.reshape(4, -1), x.reshape(-1), x.reshape(-1).numpy()):
        mu_f, var_f = net(flat, torch.zeros(flat.shape, dtype=F64))
        assert torch.equal(mu_f, mu) and torch.equal(var_f, var)
    with pytest.raises(ValueError, match=r"mu_x has shape \(71,\): a flat input must hold whole "
                                         r"samples of 2x6x6 = 72"):
        net(torch.zeros(71))


def test_deltas_add_over_batch_splits():
    """Conv, pooling and Linear deltas of a batch are the sums of the deltas of its parts."""
    net = _conv_net()
    g = gen(5)
    x = torch.randn(8, 2, 6, 6, generator=g, dtype=F64)
    y = torch.randn(8, 3, generator=g, dtype=F64)
    regression_step(net, x, y, 0.5, do_step=False)
    whole = deltas(net)
    parts = []
    for idx in (slice(0, 3), slice(3, 8)):
        regression_step(net, x[idx], y[idx], 0.5, do_step=False)
        parts.append(deltas(net))
    for name, value in whole.items():
        assert value.abs().max() > 0, name
        torch.testing.assert_close(value, parts[0][name] + parts[1][name], rtol=1e-10,
                                   atol=1e-14, msg=name)


def test_state_dict_save_load_and_to(tmp_path):
    net = _conv_net(torch.float32)
    keys = [k for k in net.state_dict()]
    assert keys == [f"{i}.{p}" for i in (0, 3, 6) for p in ("mu_w", "var_w", "mu_b", "var_b")]
    assert net.state_dict()["0.mu_w"].shape == (4, 2, 3, 3)
    net.save(tmp_path / "p.pt")
    other = _conv_net(torch.float32)
    other.layers[0].mu_w.add_(1.0)
    other.load(tmp_path / "p.pt")
    x = torch.randn(2, 2, 6, 6)
    assert torch.equal(other(x)[0], net(x)[0])
    net.to(F64)
    assert net.layers[0].mu_w.dtype == F64 and net(x)[0].dtype == F64
    torch.testing.assert_close(net(x)[0].float(), other(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build,x_shape,message", [
    (lambda: Conv2d(3, 4, 3), (2, 2, 6, 6),
     r"layer 0 \(Conv2d\(3, 4, 3.*\)\): expected 3 input channels \(batch, 3, height, "
     r"width\), got input of shape \(2, 2, 6, 6\)"),
    (lambda: Conv2d(2, 4, 5), (2, 2, 3, 3),
     r"Conv2d\(2, 4, 5.*: the input height 3 \(\+ padding 0\) is smaller than the kernel 5 "
     r"\(input of shape \(2, 2, 3, 3\)\)"),
    (lambda: Conv2d(2, 4, 3, stride=2), (2, 2, 6, 6),
     r"input height 6 does not fit: \(input height − kernel \+ padding\) = 3 is not a "
     r"multiple of the stride 2"),
    (lambda: Conv2d(2, 4, 3, in_width=6, in_height=6), (2, 2, 8, 8),
     r"built for 6x6 images \(in_height x in_width\), expected \(batch, 2, 6, 6\), got input "
     r"of shape \(2, 2, 8, 8\)"),
    (lambda: Conv2d(2, 4, 3), (2, 72),
     r"expected an image input \(batch, 2, height, width\), got shape \(2, 72\)"),
])
def test_forward_errors_name_the_layer_and_both_shapes(build, x_shape, message):
    net = Sequential(build())
    with pytest.raises(ValueError, match=message):
        net(torch.zeros(x_shape))


def test_linear_after_conv_of_the_wrong_size_names_both_shapes():
    net = Sequential(Conv2d(2, 4, 3), ReLU(), Linear(50, 2))
    with pytest.raises(ValueError, match=r"layer 2 \(Linear\(50, 2, bias=True\)\): expected input"
                                         r" of shape \(batch, 50\) or \(batch, C, H, W\) with "
                                         r"C·H·W = 50, got \(1, 4, 4, 4\)"):
        net(torch.zeros(1, 2, 6, 6))


@pytest.mark.parametrize("kwargs,message", [
    (dict(padding=1, padding_type=0), r"Conv2d: padding=1 needs padding_type 1"),
    (dict(padding_type=3), r"Conv2d: padding_type must be 0 \(none\), 1"),
    (dict(stride=0), r"Conv2d: stride must be a positive int, got 0"),
    (dict(in_width=6), r"Conv2d: give both in_width and in_height \(or neither\)"),
    (dict(in_width=2, in_height=2),
     r"Conv2d\(2, 4, 3.*\): the input height 2 \(\+ padding 0\) is smaller than the kernel 3"),
    (dict(init_method="Glorot"), r"init_method must be 'He' or 'Xavier'"),
])
def test_construction_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Conv2d(2, 4, 3, **kwargs)


def test_package_docstring_cnn_example_runs():
    """The image-network example in dptrain.tagi's docstring is kept runnable."""
    import textwrap

    import dptrain.tagi

    example = dptrain.tagi.__doc__.split("::")[2].split("\nSequence networks")[0]
    namespace: dict = {name: getattr(dptrain.tagi, name) for name in dptrain.tagi.__all__}
    namespace["torch"] = torch
    exec(textwrap.dedent(example), namespace)  # noqa: S102
    assert namespace["mu"].shape == (32, 11) and namespace["var"].shape == (32, 11)


def test_evaluation_forward_between_forward_and_backward_changes_nothing():
    """On both Conv2d paths (1-channel deterministic input: unfolded patches; otherwise the
    convolutions) an evaluation forward between a training forward and the backward leaves
    what the backward uses untouched: the same innovations and deltas as without it."""
    for c in (1, 2):
        x = torch.randn(4, c, 6, 6, generator=gen(12), dtype=F64)
        other = torch.randn(2, c, 6, 6, generator=gen(13), dtype=F64)
        d = torch.randn(4, 3, 6, 6, generator=gen(14), dtype=F64)
        results = []
        for interleave in (False, True):
            conv = _conv(15, c, 3, 3, padding=1)
            conv.forward(HiddenStates(x, None))
            if interleave:
                conv.eval().forward(HiddenStates(other, None))
                conv.train()
            back = conv.backward(DeltaStates(d, -d.abs()), need_input_delta=True)
            results.append([back.delta_mu, back.delta_var,
                            *(t.clone() for _, t in conv.named_delta_tensors())])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
