"""The device tier: every test here runs on the CPU, and again on CUDA where a GPU is present.

    pytest -m gpu            # this tier; on a machine without CUDA the cuda cases skip, saying so

A test takes the `device` fixture (a torch.device). Comparisons in float32 run with TF32 off:
torch's default lets cuDNN convolutions use TF32 (10-bit mantissa), which moves float32 results
by about 1e-3 and would hide a real 1e-5 difference; the engine's own arithmetic is what these
tests compare.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device here: the cuda cases of the GPU tier run where torch sees a GPU"

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA))]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _full_float32():
    """TF32 off for the test (the legacy flags only: torch refuses to read them back once the
    newer fp32_precision settings were used)."""
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
