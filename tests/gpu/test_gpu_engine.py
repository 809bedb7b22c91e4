"""The TAGI engine on a device against a float64 CPU reference, for every layer family: the
forward moments, the output update's innovations, every delta and the input innovations of
the backward, the parameters after each capped step, BatchNorm's running statistics, and an
evaluation forward (docs/tagi.md, One training step).

Each network is built once in float64 on the CPU (the reference) and copied, parameters and
state, to the device in the dtype under test; both then take the same two training steps.
float64 on the device must agree to 1e-10, float32 to 1e-5, relative to each value plus a tenth
of its array's scale (`tests/unit/pytagi/parity.py`, `relative_error`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dptrain.tagi import (LSTM, AvgPool2d, BatchNorm2d, Conv2d, EvenExp, HRCSoftmax,
                          LayerBlock, LayerNorm, LeakyReLU, Linear, MaxPool2d, MixtureReLU, MixtureSigmoid,
                          MixtureTanh, OutputUpdater, ReLU, Remax, ResNetBlock, Sequential,
                          Sigmoid, Softplus, Tanh, manual_seed)
from tests.unit.pytagi.parity import relative_error

pytestmark = pytest.mark.gpu

F64 = torch.float64
BATCH = 8
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _activations() -> Sequential:
    """Every elementwise activation between Linear layers; input innovations requested."""
    acts = [ReLU(), LeakyReLU(), Sigmoid(), Tanh(), Softplus(), MixtureReLU(), MixtureSigmoid(),
            MixtureTanh()]
    layers = [Linear(6, 8)]
    for act in acts:
        layers += [act, Linear(8, 8)]
    net = Sequential(*layers[:-1], Linear(8, 3), dtype=F64)
    net.input_state_update = True
    return net


def _conv_pools() -> Sequential:
    """A first Conv2d on one deterministic channel (the matrix-product path), stride 2 with
    padding_type 2, average and (overlapping) max pooling, smooth Jacobians into each."""
    return Sequential(Conv2d(1, 4, 3, padding=1, in_width=8, in_height=8), MixtureReLU(),
                      AvgPool2d(2), Conv2d(4, 4, 3, stride=2, padding=1, padding_type=2), Tanh(),
                      MaxPool2d(2, 1), Linear(4, 3), dtype=F64)


def _norms() -> Sequential:
    """BatchNorm2d and LayerNorm on images and on flat states."""
    return Sequential(Conv2d(2, 3, 3, padding=1), BatchNorm2d(3), MixtureReLU(),
                      LayerNorm([3, 6, 6]), Linear(108, 8), BatchNorm2d(8), ReLU(),
                      LayerNorm([8]), Linear(8, 3), dtype=F64)


def _resnet() -> Sequential:
    """tagi-resnet18's order (conv without bias, MixtureReLU, BatchNorm), an identity and a
    projection block (stride 2, padding_type 2), BatchNorm in both branches."""
    def main(c_in: int, c_out: int, stride: int, padding_type: int) -> LayerBlock:
        return LayerBlock(Conv2d(c_in, c_out, 3, stride=stride, padding=1,
                                 padding_type=padding_type, bias=False),
                          MixtureReLU(), BatchNorm2d(c_out))

    return Sequential(Conv2d(2, 4, 3, padding=1, bias=False), MixtureReLU(), BatchNorm2d(4),
                      ResNetBlock(main(4, 4, 1, 1)),
                      ResNetBlock(main(4, 8, 2, 2), LayerBlock(Conv2d(4, 8, 2, stride=2,
                                                                      bias=False),
                                                               BatchNorm2d(8))),
                      AvgPool2d(2), Linear(32, 3), dtype=F64)


def _lstm() -> Sequential:
    """Stacked LSTMs over windows of 4 steps (one nested, one without bias) and a Linear head
    over every step's hidden state; input innovations requested."""
    net = Sequential(LSTM(3, 5, 4), LayerBlock(LSTM(5, 4, 4, bias=False)), Linear(16, 3),
                     dtype=F64)
    net.input_state_update = True
    return net


def _remax() -> Sequential:
    return Sequential(Linear(6, 8), ReLU(), Linear(8, 4), Remax(), dtype=F64)


def _hrc() -> Sequential:
    return Sequential(Linear(6, 16), ReLU(), Linear(16, 11), dtype=F64)


def _heteros() -> Sequential:
    return Sequential(Linear(2, 8), ReLU(), Linear(8, 2), EvenExp(), dtype=F64)


Data = dict[str, torch.Tensor]
Update = Callable[[Sequential, Data, int], None]


def _standard(net: Sequential, data: Data, k: int) -> None:
    OutputUpdater(net.device).update(net.output_z_buffer, data[f"y{k}"].to(net.device),
                                     0.3, net.input_delta_z_buffer)


def _by_index(net: Sequential, data: Data, k: int) -> None:
    y_obs, y_idx = HRCSoftmax(10).encode(data[f"y{k}"], dtype=net.dtype)
    OutputUpdater(net.device).update_using_indices(
        net.output_z_buffer, y_obs.to(net.device), 0.1**2, y_idx.to(net.device),
        net.input_delta_z_buffer)


def _heteroscedastic(net: Sequential, data: Data, k: int) -> None:
    OutputUpdater(net.device).update_heteros(net.output_z_buffer, data[f"y{k}"].to(net.device),
                                             net.input_delta_z_buffer)


#: family -> (network, input shape of one sample, targets (what, width), output update)
FAMILIES: dict[str, tuple[Callable[[], Sequential], tuple[int, ...], tuple[str, int], Update]] = {
    "linear_activations": (_activations, (6,), ("normal", 3), _standard),
    "conv_pools": (_conv_pools, (1, 8, 8), ("normal", 3), _standard),
    "norms": (_norms, (2, 6, 6), ("normal", 3), _standard),
    "resnet": (_resnet, (2, 8, 8), ("normal", 3), _standard),
    "remax": (_remax, (6,), ("one_hot", 4), _standard),
    "hrc": (_hrc, (6,), ("labels", 10), _by_index),
    "heteros": (_heteros, (2,), ("normal", 1), _heteroscedastic),
    "lstm": (_lstm, (4, 3), ("normal", 3), _standard),
}


def _data(family: str) -> Data:
    _, shape, (kind, width), _ = FAMILIES[family]
    g = torch.Generator().manual_seed(1)
    data = {}
    for key in ("0", "1", "_eval"):
        data[f"x{key}"] = torch.randn((BATCH, *shape), generator=g, dtype=F64)
        if kind == "normal":
            data[f"y{key}"] = torch.randn((BATCH, width), generator=g, dtype=F64)
        elif kind == "one_hot":
            labels = torch.randint(0, width, (BATCH,), generator=g)
            data[f"y{key}"] = torch.nn.functional.one_hot(labels, width).to(F64)
        else:
            data[f"y{key}"] = torch.randint(0, width, (BATCH,), generator=g)
    return data


def _trace(net: Sequential, family: str, data: Data) -> dict[str, torch.Tensor]:
    """Everything the two steps and the eval forward produce, as float64 CPU copies."""
    update = FAMILIES[family][3]
    out: dict[str, torch.Tensor] = {}

    def keep(name: str, tensor: torch.Tensor | None) -> None:
        assert tensor is not None, name
        assert tensor.device.type == net.device.type, f"{name} on {tensor.device}"
        out[name] = tensor.detach().to("cpu", F64).clone()

    for k in (0, 1):
        net.train()
        mu, var = net(data[f"x{k}"].to(net.device, net.dtype))
        keep(f"step{k} out_mu", mu)
        keep(f"step{k} out_var", var)
        update(net, data, k)
        keep(f"step{k} update delta_mu", net.input_delta_z_buffer.delta_mu)
        keep(f"step{k} update delta_var", net.input_delta_z_buffer.delta_var)
        net.backward()
        for name, tensor in net.named_delta_tensors():
            keep(f"step{k} {name}", tensor)
        if net.input_state_update:
            keep(f"step{k} input delta_mu", net.input_delta_x.delta_mu)
            keep(f"step{k} input delta_var", net.input_delta_x.delta_var)
        net.step()
        for name, tensor in net.named_parameter_tensors() + net.named_state_tensors():
            keep(f"step{k} after {name}", tensor)
    net.eval()
    mu, var = net(data["x_eval"].to(net.device, net.dtype))
    keep("eval out_mu", mu)
    keep("eval out_var", var)
    return out


def _on(device: torch.device, dtype: torch.dtype, reference: Sequential,
        family: str) -> Sequential:
    """The reference's twin (same parameters and state) on `device` in `dtype`."""
    net = FAMILIES[family][0]()
    net.load_state_dict(reference.state_dict())
    net.input_state_update = reference.input_state_update
    return net.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_on_the_device_equals_the_float64_cpu_reference(family, dtype, device):
    manual_seed(3)
    reference = FAMILIES[family][0]()
    twin = _on(device, dtype, reference, family)
    data = _data(family)
    want = _trace(reference, family, data)
    got = _trace(twin, family, data)
    assert set(got) == set(want)
    errors = {name: relative_error(got[name], want[name])[0] for name in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE[dtype], f"{worst}: relative error {errors[worst]:.3g}"
    if any(".num_batches_tracked" in name for name in want):  # BatchNorm ran twice
        assert all(got[n].eq(2).all() for n in got if n.startswith("step1 after") and
                   n.endswith("num_batches_tracked"))


def test_the_comparison_notices_a_wrong_device_result(device):
    """The harness fails on a one-element change in one delta (what a device bug would do)."""
    manual_seed(3)
    reference = _resnet()
    twin = _on(device, F64, reference, "resnet")
    data = _data("resnet")
    want = _trace(reference, "resnet", data)
    got = _trace(twin, "resnet", data)
    got["step1 3.main.0.delta_mu_w"].view(-1)[5] *= 1 + 1e-6
    errors = {name: relative_error(got[name], want[name])[0] for name in want}
    assert max(errors.values()) > TOLERANCE[F64]
