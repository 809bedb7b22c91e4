"""DDPSequential.compile() on 2 real gloo ranks: the compiled step (all-reduce outside the
program) in sum mode equals one process stepping the global batch eagerly (contract 1), the
replicas stay bit-identical (contract 2), and a step whose local batch has another size (a
short last batch, a rank without a sample) runs the wrapper's eager loop, joining the same
collectives. Traced with the "aot_eager" backend (the captured graph, no code generation), and
stepped by the native library (an LSTM, Linear and ReLU stack)."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import LSTM, Linear, OutputUpdater, ReLU, Sequential, manual_seed
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64
#: per step, the local batch of each rank: the same shape three times (compiled from the
#: second), then a short last batch and a rank without a sample (eager)
SIZES = [(3, 6), (3, 6), (3, 6), (3, 6), (1, 2), (0, 4)]


def _net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(LSTM(2, 4, 3), Linear(12, 8), ReLU(), Linear(8, 1), dtype=F64)


def _batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(batch, 3, 2, generator=g, dtype=F64),
            torch.randn(batch, 1, generator=g, dtype=F64))


def _compiled_world(rank: int, world_size: int, native: bool) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    ddp = DDPSequential(_net(seed=rank), config)
    step = ddp.compile(native=True) if native else ddp.compile(backend="aot_eager")
    reference = _net(seed=0)
    worst = 0.0
    for k, sizes in enumerate(SIZES):
        x, y = _batch(k, sum(sizes))
        start = sum(sizes[:rank])
        step(x[start:start + sizes[rank]], y[start:start + sizes[rank]], 0.05 + 0.01 * k)
        reference(x)
        OutputUpdater().update(reference.output_z_buffer, y, 0.05 + 0.01 * k,
                               reference.input_delta_z_buffer)
        reference.backward()
        reference.step()
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    ddp.check_replicas()
    return dict(worst=worst, compiled=step.compiled_steps, eager=step.eager_steps,
                fallback=step.fallback_reason, fingerprint=ddp.params_fingerprint(),
                native=bool(step._natives))


@pytest.mark.parametrize("native", [False, True], ids=["traced", "native"])
def test_compiled_ddp_step_equals_one_process_on_the_global_batch(native):
    results = run_world(_compiled_world, native, world_size=2, timeout_s=180)
    for r in results:
        assert r["fallback"] is None
        assert r["worst"] < 1e-12, r["worst"]
    # the program: steps 2-4, the rest eager; the native step: every step with a sample on
    # the rank, whatever its local batch size (a rank without one steps the eager loop)
    with_samples = [sum(1 for sizes in SIZES if sizes[rank]) for rank in range(2)]
    assert [r["compiled"] for r in results] == (with_samples if native else [3, 3])
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    assert [r["native"] for r in results] == [native, native]
