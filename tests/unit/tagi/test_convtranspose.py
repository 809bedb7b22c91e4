"""ConvTranspose2d against oracles: an index-by-index transcription of pytagi's definition
(every input pixel spreads k×k weighted copies over the output) for forward moments,
innovations and deltas, Monte Carlo moments, pytagi's autoencoder decoder, the flat state of a
Linear, batch additivity, init, save/load and errors (docs/tagi.md, ConvTranspose2d)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dptrain.tagi import (ConvTranspose2d, HiddenStates, Linear, MixtureReLU, OutputUpdater,
                          Sequential, Tanh, manual_seed)
from dptrain.tagi.states import DeltaStates
from tests.unit.tagi.helpers import (F64, assert_close_mc, deltas, gen, monte_carlo,
                                     regression_step, spread_conv)

WINDOWS = [dict(), dict(stride=2, padding=1), dict(stride=2, padding=1, padding_type=2),
           dict(stride=3, padding=2, padding_type=2), dict(padding=1, bias=False),
           dict(stride=2, padding=2), dict(padding=3, padding_type=2)]


def _convT(seed: int, c: int, o: int, k: int, **kwargs) -> ConvTranspose2d:
    return spread_conv(ConvTranspose2d, seed, c, o, k, **kwargs)


def _connections(layer: ConvTranspose2d, h: int, w: int):
    """(c, i, j, o, kh, kw, y, x): input pixel (c, i, j) reaches output (o, y, x) through weight
    (c, o, kh, kw). pytagi's rule: y = s·i + kh − p_top; type 1 cuts p on every side
    (p_top = p), type 2 only on the bottom and right (p_top = 0)."""
    win = layer.window
    s, k = win.stride, win.kernel
    top = win.padding if win.padding_type == 1 else 0
    ho, wo = (s * (n - 1) + k - win.total_padding for n in (h, w))
    for c in range(layer.in_channels):
        for o in range(layer.out_channels):
            for kh in range(k):
                for kw in range(k):
                    for i in range(h):
                        for j in range(w):
                            y, x = s * i + kh - top, s * j + kw - top
                            if 0 <= y < ho and 0 <= x < wo:
                                yield c, i, j, o, kh, kw, y, x


def _reference(layer: ConvTranspose2d, mu_a, var_a, jcb, delta_mu, delta_var):
    """Sums over the connections, one at a time (vectorised over the batch only)."""
    batch, _, h, w = mu_a.shape
    win = layer.window
    ho, wo = (win.stride * (n - 1) + win.kernel - win.total_padding for n in (h, w))
    shape = (batch, layer.out_channels, ho, wo)
    mu_z, var_z = torch.zeros(shape, dtype=F64), torch.zeros(shape, dtype=F64)
    d_mu_in, d_var_in = torch.zeros_like(mu_a), torch.zeros_like(mu_a)
    g_mu_w, g_var_w = torch.zeros_like(layer.mu_w), torch.zeros_like(layer.mu_w)
    for c, i, j, o, kh, kw, y, x in _connections(layer, h, w):
        m_w, v_w = layer.mu_w[c, o, kh, kw], layer.var_w[c, o, kh, kw]
        m_a, v_a = mu_a[:, c, i, j], var_a[:, c, i, j]
        mu_z[:, o, y, x] += m_w * m_a
        var_z[:, o, y, x] += (m_w**2 + v_w) * v_a + v_w * m_a**2
        d_mu_in[:, c, i, j] += m_w * delta_mu[:, o, y, x]
        d_var_in[:, c, i, j] += m_w**2 * delta_var[:, o, y, x]
        g_mu_w[c, o, kh, kw] += (m_a * delta_mu[:, o, y, x]).sum()
        g_var_w[c, o, kh, kw] += (m_a**2 * delta_var[:, o, y, x]).sum()
    want = {"mu_z": mu_z, "var_z": var_z, "delta_mu_in": jcb * d_mu_in,
            "delta_var_in": jcb**2 * d_var_in,
            "delta_mu_w": layer.var_w * g_mu_w, "delta_var_w": layer.var_w**2 * g_var_w}
    if layer.bias:
        want["mu_z"] = mu_z + layer.mu_b.view(1, -1, 1, 1)
        want["var_z"] = var_z + layer.var_b.view(1, -1, 1, 1)
        want["delta_mu_b"] = layer.var_b * delta_mu.sum((0, 2, 3))
        want["delta_var_b"] = layer.var_b**2 * delta_var.sum((0, 2, 3))
    return want


@pytest.mark.parametrize("kwargs", WINDOWS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in
                                                                     kw.items()) or "default")
def test_forward_backward_and_deltas_equal_the_connection_sums(kwargs):
    """m_Z, v_Z, the input innovations (J applied) and every parameter delta, against the sums
    over pytagi's connections for both padding types, strides 1-3, with and without bias."""
    layer = _convT(0, 2, 3, 3, **kwargs)
    g = gen(1)
    mu_a = torch.randn(2, 2, 3, 3, generator=g, dtype=F64)
    var_a = 0.1 + 0.5 * torch.rand(2, 2, 3, 3, generator=g, dtype=F64)
    jcb = 0.2 + torch.rand(2, 2, 3, 3, generator=g, dtype=F64)
    out = layer.forward(HiddenStates(mu_a, var_a, jcb))
    delta_mu = torch.randn(out.mu_a.shape, generator=g, dtype=F64)
    delta_var = -torch.rand(out.mu_a.shape, generator=g, dtype=F64)
    back = layer.backward(DeltaStates(delta_mu, delta_var), need_input_delta=True)
    layer.scale_deltas_()
    want = _reference(layer, mu_a, var_a, jcb, delta_mu, delta_var)
    got = {"mu_z": out.mu_a, "var_z": out.var_a, "delta_mu_in": back.delta_mu,
           "delta_var_in": back.delta_var, **dict(layer.named_delta_tensors())}
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12, msg=key)
    assert out.jcb is None


def test_forward_moments_match_monte_carlo():
    """m_Z, v_Z are the exact mean and variance of W ⋆ᵀ A + B for independent Gaussians."""
    layer = _convT(2, 2, 2, 3, stride=2, padding=1, padding_type=2)
    g = gen(3)
    mu_a = torch.randn(1, 2, 2, 2, generator=g, dtype=F64)
    var_a = 0.1 + 0.5 * torch.rand(1, 2, 2, 2, generator=g, dtype=F64)
    out = layer.forward(HiddenStates(mu_a, var_a))
    n = 60_000
    w = layer.mu_w + layer.var_w.sqrt() * torch.randn((n,) + layer.mu_w.shape, generator=g,
                                                      dtype=F64)
    b = layer.mu_b + layer.var_b.sqrt() * torch.randn(n, 2, generator=g, dtype=F64)
    a = mu_a + var_a.sqrt() * torch.randn((n, 2, 2, 2), generator=g, dtype=F64)
    # n draws as the groups of one grouped transposed convolution, then the type-2 crop
    z = F.conv_transpose2d(a.reshape(1, -1, 2, 2), w.reshape(-1, 2, 3, 3), b.reshape(-1),
                           stride=2, groups=n).reshape(n, 2, 5, 5)[:, :, :4, :4]
    mc = monte_carlo(z, z)
    assert out.mu_a.shape == (1, 2, 4, 4)
    assert_close_mc(out.mu_a[0], mc.mean, mc.mean_se, "ConvTranspose2d m_Z")
    assert_close_mc(out.var_a[0], mc.var, mc.var_se, "ConvTranspose2d v_Z")


def _decoder(dtype=F64) -> Sequential:
    """pytagi's autoencoder decoder (examples/autoencoder.py), its arguments verbatim."""
    manual_seed(0)
    return Sequential(
        Linear(16, 32 * 7 * 7), MixtureReLU(),
        ConvTranspose2d(32, 32, 3, bias=True, stride=2, padding=1, padding_type=2,
                        in_width=7, in_height=7), MixtureReLU(),
        ConvTranspose2d(32, 16, 3, bias=True, stride=2, padding=1, padding_type=2),
        MixtureReLU(), ConvTranspose2d(16, 1, 3, bias=True, padding=1), dtype=dtype)


def test_pytagi_autoencoder_decoder_upsamples_to_28x28_and_sends_innovations_back():
    """7x7 → 14x14 → 28x28 → 28x28 from a 16-unit code; trained on flat pixels it moves its
    output toward them, and with input_state_update its input innovations have the code's
    shape (B, 16): what pytagi's loop copies into the encoder."""
    net = _decoder()
    net.input_state_update = True
    g = gen(4)
    code = torch.randn(2, 16, generator=g, dtype=F64)
    pixels = torch.rand(2 * 28 * 28, generator=g, dtype=F64)
    mu, var = net(code, 0.1 * torch.ones_like(code))
    assert mu.shape == (2, 1, 28, 28) and bool((var > 0).all())
    before = (mu.reshape(-1) - pixels).pow(2).mean().item()
    for _ in range(3):
        net(code, 0.1 * torch.ones_like(code))
        OutputUpdater().update(net.output_z_buffer, pixels, 0.1, net.input_delta_z_buffer)
        net.backward()
        net.step()
    assert net.input_delta_x.delta_mu.shape == (2, 16)
    assert bool((net.input_delta_x.delta_var <= 0).all())
    net.eval()
    after = (net(code, 0.1 * torch.ones_like(code))[0].reshape(-1) - pixels).pow(2).mean().item()
    assert after < 0.5 * before, (before, after)


def test_pytagi_autoencoder_learns_through_the_chained_innovations():
    """pytagi's whole autoencoder loop (examples/autoencoder.py: its encoder and decoder as
    written, its σ_v = 16): the decoder's input innovations (input_state_update) become the
    encoder's output innovations. Six steps on one batch of 8 images bring the reconstruction
    error to under half (measured: 0.393 → 0.100), and both networks' parameters move."""
    from dptrain.tagi import AvgPool2d, BatchNorm2d, Conv2d

    manual_seed(1)
    encoder = Sequential(
        Conv2d(1, 16, 3, bias=False, padding=1, in_width=28, in_height=28), MixtureReLU(),
        BatchNorm2d(16), AvgPool2d(3, 2, 1, 2), Conv2d(16, 32, 3, bias=False, padding=1),
        MixtureReLU(), BatchNorm2d(32), AvgPool2d(3, 2, 1, 2), Linear(32 * 7 * 7, 128),
        MixtureReLU(), Linear(128, 16))
    decoder = _decoder(torch.float32)
    decoder.input_state_update = True
    before = encoder.flat_params.clone(), decoder.flat_params.clone()
    x = torch.rand(8, 1, 28, 28, generator=gen(12))
    errors = []
    for _ in range(6):
        code = encoder(x)
        mu, _ = decoder(*code)
        errors.append((mu - x).pow(2).mean().item())
        OutputUpdater().update(decoder.output_z_buffer, x.reshape(-1), 16.0**2,
                               decoder.input_delta_z_buffer)
        decoder.backward()
        decoder.step()
        encoder.input_delta_z_buffer.delta_mu = decoder.input_delta_x.delta_mu
        encoder.input_delta_z_buffer.delta_var = decoder.input_delta_x.delta_var
        encoder.backward()
        encoder.step()
    assert errors[-1] < 0.5 * errors[0], errors
    assert not torch.equal(before[0], encoder.flat_params)
    assert not torch.equal(before[1], decoder.flat_params)


def test_flat_state_of_a_linear_is_read_as_an_image():
    """After a Linear the (B, C·H·W) state is unflattened C-major; the innovations go back flat
    and equal those of the layer run on the image directly."""
    manual_seed(5)
    net = Sequential(Linear(3, 8), Tanh(), ConvTranspose2d(2, 2, 3, stride=2, in_width=2,
                                                           in_height=2), dtype=F64)
    x = torch.randn(4, 3, generator=gen(6), dtype=F64)
    net(x)
    hidden = net.layers[1].forward(net.layers[0].forward(HiddenStates(x, None)))
    image = HiddenStates(*(t.reshape(4, 2, 2, 2) for t in (hidden.mu_a, hidden.var_a,
                                                         hidden.jcb)))
    layer = net.layers[2]
    direct = layer.forward(image)
    torch.testing.assert_close(net.output_z_buffer.mu_a, direct.mu_a)
    d = DeltaStates(torch.randn(direct.mu_a.shape, dtype=F64),
                    -torch.rand(direct.mu_a.shape, dtype=F64))
    from_image = layer.backward(d, need_input_delta=True)
    net(x)
    from_flat = layer.backward(d, need_input_delta=True)
    assert from_flat.delta_mu.shape == (4, 8)
    torch.testing.assert_close(from_flat.delta_mu, from_image.delta_mu.reshape(4, 8))
    torch.testing.assert_close(from_flat.delta_var, from_image.delta_var.reshape(4, 8))


def test_flat_network_inputs_and_image_inputs_give_the_same_numbers():
    manual_seed(7)
    net = Sequential(ConvTranspose2d(2, 3, 2, stride=2, in_width=3, in_height=3), MixtureReLU(),
                     ConvTranspose2d(3, 1, 3, padding=1), dtype=F64)
    x = torch.randn(2, 2, 3, 3, generator=gen(8), dtype=F64)
    image = net(x)
    for flat in (x.reshape(2, -1), x.reshape(-1)):
        for a, b in zip(net(flat), image):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_deltas_add_over_batch_splits():
    """TAGI's batch additivity (the basis of sum-mode data parallelism)."""
    def net():
        manual_seed(9)
        return Sequential(ConvTranspose2d(2, 2, 3, stride=2, padding=1, padding_type=2,
                                          in_width=2, in_height=2), MixtureReLU(),
                          ConvTranspose2d(2, 1, 2), dtype=F64)
    g = gen(10)
    x, y = torch.randn(6, 2, 2, 2, generator=g, dtype=F64), torch.randn(6, 25, generator=g,
                                                                          dtype=F64)
    whole, parts = net(), net()
    regression_step(whole, x, y.reshape(-1), 0.2, do_step=False)
    total = deltas(whole)
    regression_step(parts, x[:2], y[:2].reshape(-1), 0.2, do_step=False)
    first = deltas(parts)
    regression_step(parts, x[2:], y[2:].reshape(-1), 0.2, do_step=False)
    for key, value in deltas(parts).items():
        torch.testing.assert_close(first[key] + value, total[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method,gain", [("He", 1.0), ("Xavier", 0.5)])
def test_init_uses_the_fan_of_the_kernel(method, gain):
    """pytagi: fan_in = C k², fan_out = O k², as Conv2d; weights (C, O, k, k)."""
    manual_seed(11)
    layer = ConvTranspose2d(8, 4, 3, init_method=method, gain_weight=gain, gain_bias=2 * gain,
                            dtype=F64)
    scale2 = 1 / (8 * 9) if method == "He" else 2 / ((8 + 4) * 9)
    assert layer.mu_w.shape == (8, 4, 3, 3) and layer.mu_b.shape == (4,)
    torch.testing.assert_close(layer.var_w, torch.full_like(layer.var_w, gain**2 * scale2))
    torch.testing.assert_close(layer.var_b, torch.full_like(layer.var_b, 4 * gain**2 * scale2))
    assert abs(layer.mu_w.var().item() / scale2 - 1) < 0.25


def test_state_dict_save_load_and_to(tmp_path):
    net = _decoder(torch.float32)
    state = net.state_dict()
    assert state["2.mu_w"].shape == (32, 32, 3, 3) and state["6.mu_b"].shape == (1,)
    net.save(tmp_path / "decoder.pt")
    other = Sequential(Linear(16, 32 * 7 * 7), MixtureReLU(),
                       ConvTranspose2d(32, 32, 3, stride=2, padding=1, padding_type=2,
                                       in_width=7, in_height=7), MixtureReLU(),
                       ConvTranspose2d(32, 16, 3, stride=2, padding=1, padding_type=2),
                       MixtureReLU(), ConvTranspose2d(16, 1, 3, padding=1))
    other.load(tmp_path / "decoder.pt")
    code = torch.randn(2, 16)
    for a, b in zip(other.eval()(code), net.eval()(code)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other.to(F64)
    torch.testing.assert_close(other(code.double())[0], net(code)[0].double(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(in_width=4), "give both in_width and in_height"),
    (dict(padding=1, padding_type=0), "padding_type"),
    (dict(kernel_size=1, padding=1, in_width=1, in_height=1), "1x1 input gives an output of "
                                                             "-1x-1"),
    (dict(out_channels=0), "out_channels must be a positive int"),
])
def test_construction_errors(kwargs, message):
    args = dict(in_channels=2, out_channels=3, kernel_size=3) | kwargs
    with pytest.raises(ValueError, match=message):
        ConvTranspose2d(**args)


@pytest.mark.parametrize("layers,x_shape,message", [
    (lambda: [ConvTranspose2d(2, 3, 3)], (4, 3, 5, 5),
     r"0 \(ConvTranspose2d\(2, 3, 3.*expected an input of shape \(batch, 2, height, width\), "
     r"got \(4, 3, 5, 5\)"),
    (lambda: [ConvTranspose2d(2, 3, 3, in_width=4, in_height=4)], (4, 2, 5, 5),
     r"0 \(ConvTranspose2d.*\(batch, 2, 4, 4\) or flat \(batch, 32\), got \(4, 2, 5, 5\)"),
    (lambda: [Linear(3, 32), ConvTranspose2d(2, 3, 3)], (4, 3),
     r"1 \(ConvTranspose2d.*got \(4, 32\); give in_width and in_height to take a flat state"),
])
def test_forward_errors_name_the_layer_and_both_shapes(layers, x_shape, message):
    with pytest.raises(ValueError, match=r"layer " + message):
        Sequential(*layers())(torch.zeros(x_shape))


def test_package_docstring_decoder_example_runs():
    """The ConvTranspose2d example at the end of dptrain.tagi's docstring is kept runnable."""
    import textwrap

    import dptrain.tagi

    example = dptrain.tagi.__doc__.split("::")[-1]
    namespace: dict = {name: getattr(dptrain.tagi, name) for name in dptrain.tagi.__all__}
    namespace["torch"] = torch
    exec(textwrap.dedent(example), namespace)  # noqa: S102
    assert namespace["mu"].shape == (32, 1, 28, 28)
