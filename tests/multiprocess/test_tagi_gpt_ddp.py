"""tagi-gpt under DDPSequential on 2 real gloo ranks (docs/design.md contracts 1, 2; docs/tagi.md,
A TAGI GPT): every position of every window observed through the hierarchical softmax."""

from __future__ import annotations

import pytest
import torch

from dptrain.models import ModelOptions, build_model
from dptrain.learners.tagi_learner import encode_positions
from dptrain.runtime import DDPConfig
from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64
SIZES = [3, 5]  # uneven local batches of windows; the global batch is 8
VOCAB, CONTEXT = 11, 6
HRC = HRCSoftmax(VOCAB)


def _gpt(seed: int):
    manual_seed(seed)
    return build_model("tagi-gpt", (CONTEXT,), HRC.num_outputs,
                       ModelOptions(width=8, heads=2, layers=2, vocab_size=VOCAB, dtype=F64))


def _windows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    ids = torch.randint(0, VOCAB, (sum(SIZES), CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _step(net, x: torch.Tensor, y: torch.Tensor) -> None:
    net(x)
    obs, idx = encode_positions(HRC, y, F64)
    OutputUpdater().update_using_indices(net.output_z_buffer, obs, 0.25, idx,
                                         net.input_delta_z_buffer)
    net.backward()
    net.step()


def _world(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    start, size = sum(SIZES[:rank]), SIZES[rank]
    ddp = DDPSequential(_gpt(seed=rank), config)  # rank 1's start is replaced by rank 0's
    reference = _gpt(seed=0)
    worst = 0.0
    for step in range(3):
        x, y = _windows(step)
        _step(ddp, x[start:start + size], y[start:start + size])
        _step(reference, x, y)
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    ddp.check_replicas()
    return {"worst": worst, "fingerprint": ddp.params_fingerprint(),
            "moved": (reference.flat_params - _gpt(seed=0).flat_params).abs().max().item()}


def _average_world(rank: int, world_size: int) -> dict:
    """Average mode (pytagi's): (1/N) Σ_r Δ_r of each rank's 4 windows at the same parameters,
    capped as for 4 windows."""
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    local = 4
    ddp = DDPSequential(_gpt(seed=rank), config, average=True)
    reference, probe = _gpt(seed=0), _gpt(seed=0)
    worst = 0.0
    for step in range(3):
        x, y = _windows(step)
        mine = slice(rank * local, (rank + 1) * local)
        _step(ddp, x[mine], y[mine])
        total = torch.zeros_like(reference.flat_deltas)
        for r in range(world_size):
            probe.load_state_dict(reference.state_dict())
            shard = slice(r * local, (r + 1) * local)
            probe(x[shard])
            obs, idx = encode_positions(HRC, y[shard], F64)
            OutputUpdater().update_using_indices(probe.output_z_buffer, obs, 0.25, idx,
                                                 probe.input_delta_z_buffer)
            probe.backward()
            total += probe.flat_deltas
        reference.flat_deltas.copy_(total / world_size)
        reference.cap_batch_size = local
        reference.step()
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    ddp.check_replicas()
    return {"worst": worst}


def test_average_mode_applies_the_mean_of_the_ranks_deltas():
    """docs/tagi.md, Data-parallel TAGI: average mode steps by the mean of the ranks' deltas
    (pytagi's), here through every layer of the TAGI GPT; replicas bit-identical."""
    for r in run_world(_average_world, world_size=2, timeout_s=120):
        assert r["worst"] < 1e-12, r


def test_sum_mode_equals_one_process_on_the_global_batch_of_windows():
    """Contract 1: 2 ranks in sum mode (3 and 5 windows) step like one process on the 8
    windows (float64), through embedding, attention with RoPE, RMSNorm, residual blocks and
    the per-position head; contract 2: replicas bit-identical."""
    results = run_world(_world, world_size=2, timeout_s=120)
    for r in results:
        assert r["moved"] > 1e-3, r  # the steps changed the parameters
        assert r["worst"] < 1e-12, r
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
