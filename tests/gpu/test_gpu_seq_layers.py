"""Embedding and SLSTM + smoother on a device against a float64 CPU reference: outputs, every
delta, the parameters after each step, the carried states and the smoothed ones (the same
tolerances as test_gpu_engine.py: 1e-10 in float64, 1e-5 in float32)."""

from __future__ import annotations

import pytest
import torch

from dptrain.tagi import (SLSTM, Embedding, Linear, OutputUpdater, ReLU, Sequential, SLinear,
                          manual_seed)
from tests.unit.pytagi.parity import relative_error

pytestmark = pytest.mark.gpu

F64 = torch.float64
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _embedding() -> Sequential:
    return Sequential(Embedding(9, 4, input_size=3, padding_idx=2), Linear(12, 6), ReLU(),
                      Linear(6, 2), dtype=F64)


def _slstm() -> Sequential:
    return Sequential(SLSTM(3, 5, 1), SLSTM(5, 4, 1), SLinear(4, 2), dtype=F64)


def _trace(net: Sequential, ids: bool) -> dict[str, torch.Tensor]:
    """Five training steps on fixed data (2 samples or series), then the smoother if any."""
    g = torch.Generator().manual_seed(3)
    seen = {}
    for k in range(5):
        x = torch.randint(0, 9, (2, 3), generator=g).to(F64) if ids else \
            torch.randn(2, 3, generator=g, dtype=F64)
        y = torch.randn(2, 2, generator=g, dtype=F64)
        mu, var = net(x.to(net.device, net.dtype))
        seen[f"step{k} out_mu"], seen[f"step{k} out_var"] = mu, var
        OutputUpdater(net.device).update(net.output_z_buffer, y.to(net.device, net.dtype), 0.1,
                                         net.input_delta_z_buffer)
        net.backward()
        seen.update((f"step{k} {key}", t.clone()) for key, t in net.named_delta_tensors())
        net.step()
        seen.update((f"step{k} after {key}", t.clone())
                    for key, t in net.named_parameter_tensors())
    if not ids:
        seen["carried h"] = net.layers[1].mu_h_prior.clone()
        seen["smooth mu"], seen["smooth var"] = net.smoother()
        for name in ("mu_h", "var_h", "mu_c", "var_c"):
            seen[f"smooth 0.{name}"] = getattr(net.layers[0], f"{name}_smooths")
    return seen


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", ["embedding", "slstm"])
def test_sequence_layers_on_the_device_equal_the_float64_cpu_reference(family, dtype, device):
    manual_seed(0)
    reference = _embedding() if family == "embedding" else _slstm()
    manual_seed(0)
    net = _embedding() if family == "embedding" else _slstm()
    net.to(device, dtype)
    want, got = _trace(reference, family == "embedding"), _trace(net, family == "embedding")
    assert set(got) == set(want)
    worst = max((relative_error(got[key], want[key].numpy())[0], key) for key in want)
    assert worst[0] <= TOLERANCE[dtype], worst
