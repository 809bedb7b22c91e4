"""Model FLOPs utilisation: the FLOPs a model's training needs per token, times the tokens per
second the run reached, over the peak rate of the devices it ran on.

    peak = peak_flops(torch.device("cpu"), torch.float32)   # (rate, where it comes from)
    mfu(flops_per_token=6.1e6, tokens_per_s=2.0e4, peak=peak.rate, world_size=2)

The FLOPs per token come from the model itself (the learner's `flops_per_token()`: a
`flops_per_token` method or attribute of the unwrapped module, forward and backward counted, as
its author defines them); a model without one gets no MFU. The peak is `--peak-flops` when given; on CUDA the device's dense peak for the
dtype from `CUDA_PEAK_TFLOPS` (the vendors' data sheets); on a CPU what a float matrix multiply
reaches in this process, measured once when the run starts (there is no data sheet for "this
many cores of this CPU under this cgroup", and the rate torch itself reaches is the ceiling a
torch model can hope for).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

CUDA_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # name fragment (matched in order: H100 PCIe before H100, A100 before A10, L40S before L4),
    # dense tensor-core TFLOP/s by dtype (no sparsity); float32 without TF32 (torch's default).
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
)
"""Per-GPU dense peaks in TFLOP/s, from the vendors' data sheets (SXM parts unless named)."""

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Peak:
    rate: float | None
    """FLOP/s of one device; None when unknown (then no MFU)."""
    source: str
    """Where the rate comes from, for summary.json."""


def cuda_peak(device_name: str, dtype: torch.dtype) -> Peak:
    """The table's peak of a CUDA device for `dtype` (the autocast dtype for bf16/fp16 runs)."""
    key = _DTYPE_NAMES.get(dtype)
    for fragment, rates in CUDA_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            if key in rates:
                return Peak(rates[key] * 1e12, f"table: {fragment} {key}")
            break
    return Peak(None, f"no peak known for {device_name} at {dtype}: give --peak-flops")


def measured_matmul_flops(dtype: torch.dtype = torch.float32, size: int = 512,
                          min_seconds: float = 0.2) -> float:
    """FLOP/s of a `size` x `size` matrix product on this process's CPU threads, after one
    warm-up product; timed over at least `min_seconds`."""
    a = torch.randn(size, size, dtype=dtype, generator=torch.Generator().manual_seed(0))
    b = torch.randn(size, size, dtype=dtype, generator=torch.Generator().manual_seed(1))
    torch.mm(a, b)
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return 2.0 * size ** 3 * count / elapsed


def peak_flops(device: torch.device, dtype: torch.dtype, given: float | None = None) -> Peak:
    """The peak FLOP/s of one of the run's devices: `given` (--peak-flops), else the CUDA
    table, else measured on this CPU."""
    if given:
        return Peak(float(given), "--peak-flops")
    if device.type == "cuda":
        return cuda_peak(torch.cuda.get_device_name(device), dtype)
    rate = measured_matmul_flops(dtype if dtype in (torch.float32, torch.float64)
                                 else torch.float32)
    return Peak(rate, f"measured: {dtype} matmul on this CPU ({torch.get_num_threads()} "
                      f"thread(s))")


def mfu(*, flops_per_token: float, tokens_per_s: float, peak: float, world_size: int) -> float:
    """The share of the devices' peak the run used: achieved FLOP/s over all devices' peak."""
    return flops_per_token * tokens_per_s / (peak * world_size)
