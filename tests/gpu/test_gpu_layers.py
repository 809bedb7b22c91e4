"""ConvTranspose2d and the softmax heads on a device against a float64 CPU reference: outputs,
every delta and the parameters after each step (the same tolerances as test_gpu_engine.py:
1e-10 in float64, 1e-5 in float32)."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (AvgPool2d, ClosedFormSoftmax, Conv2d, ConvTranspose2d, Linear,
                          MixtureReLU, OutputUpdater, ReLU, Sequential, Softmax, manual_seed)
from tests.unit.pytagi.parity import relative_error

pytestmark = pytest.mark.gpu

F64 = torch.float64
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _autoencoder() -> Sequential:
    """Conv2d encoder, then both padding types of ConvTranspose2d, the first one reading a
    Linear's flat output as 2x3x3 images."""
    return Sequential(Conv2d(1, 2, 3, padding=1, in_width=6, in_height=6), MixtureReLU(),
                      AvgPool2d(2, 2), Linear(18, 18), MixtureReLU(),
                      ConvTranspose2d(2, 3, 3, stride=2, padding=1, padding_type=2,
                                      in_width=3, in_height=3),
                      MixtureReLU(), ConvTranspose2d(3, 1, 3, padding=1), dtype=F64)


def _classifier(head) -> Sequential:
    return Sequential(Linear(4, 8), ReLU(), Linear(8, 3), head(), dtype=F64)


BUILDERS = {"autoencoder": _autoencoder, "softmax": lambda: _classifier(Softmax),
            "cf_softmax": lambda: _classifier(ClosedFormSoftmax)}


def _trace(net: Sequential, family: str) -> dict[str, torch.Tensor]:
    """Four training steps on fixed data (4 samples), then an eval forward."""
    g = torch.Generator().manual_seed(5)
    seen = {}
    for k in range(5):
        if family == "autoencoder":
            x = torch.rand(4, 1, 6, 6, generator=g, dtype=F64)
            y = x.reshape(-1)
        else:
            x = torch.randn(4, 4, generator=g, dtype=F64)
            y = torch.nn.functional.one_hot(torch.randint(0, 3, (4,), generator=g), 3).to(F64)
        if k == 4:
            net.eval()
        mu, var = net(x.to(net.device, net.dtype))
        seen[f"step{k} out_mu"], seen[f"step{k} out_var"] = mu, var
        if k == 4:
            break
        OutputUpdater(net.device).update(net.output_z_buffer, y.to(net.device, net.dtype),
                                         0.05, net.input_delta_z_buffer)
        net.backward()
        seen.update((f"step{k} {key}", t.clone()) for key, t in net.named_delta_tensors())
        net.step()
        seen.update((f"step{k} after {key}", t.clone())
                    for key, t in net.named_parameter_tensors())
    return seen


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_layers_on_the_device_equal_the_float64_cpu_reference(family, dtype, device):
    manual_seed(0)
    reference = BUILDERS[family]()
    manual_seed(0)
    net = BUILDERS[family]()
    net.to(device, dtype)
    want, got = _trace(reference, family), _trace(net, family)
    assert set(got) == set(want)
    worst = max((relative_error(got[key], want[key].numpy())[0], key) for key in want)
    assert worst[0] <= TOLERANCE[dtype], worst
