"""The compiled training step (`Sequential.compile()`) on CUDA, generated code and its CUDA-graph
replay ("reduce-overhead"), against the eager loop on the same device: float64 to 1e-12 relative,
float32 to 1e-6, as on the CPU (tests/unit/tagi/test_compiled.py). CUDA only: the CPU cases are
in the unit tier."""

from __future__ import annotations

import pytest
import torch

from dptrain import tagi
from tests.gpu.conftest import HAS_CUDA, NO_CUDA
from tests.unit.tagi.test_compiled import _eager_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)]


def _lstm() -> tagi.Sequential:
    return tagi.Sequential(tagi.LSTM(1, 8, 5), tagi.LSTM(8, 8, 5), tagi.Linear(40, 1))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "cuda-graph"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_compiled_step_on_cuda_equals_eager(mode, dtype, tol):
    nets = []
    for _ in range(2):
        tagi.manual_seed(0)
        nets.append(_lstm().to("cuda", dtype))
    eager, net = nets
    step = net.compile(mode=mode)
    g = torch.Generator().manual_seed(1)
    for k in range(5):
        x = torch.randn(5, 5, generator=g, dtype=dtype).cuda()
        y = torch.randn(5, 1, generator=g, dtype=dtype).cuda()
        _eager_step(eager, x, y, 0.1 + 0.05 * k, "plain")
        step(x, y, 0.1 + 0.05 * k)
    assert step.fallback_reason is None and step.compiled_steps == 4
    a, b = eager.flat_params, net.flat_params
    assert torch.allclose(b, a, rtol=tol, atol=tol * float(a.abs().max()))
