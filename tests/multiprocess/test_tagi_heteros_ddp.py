"""The heteroscedastic update under DDPSequential on 2 real gloo ranks: it is per sample, so sum
mode still equals one process on the global batch, and average mode keeps replicas identical."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import EvenExp, Linear, OutputUpdater, ReLU, Sequential, manual_seed
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64


def _net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(3, 16), ReLU(), Linear(16, 16), ReLU(), Linear(16, 4), EvenExp(),
                      dtype=F64)


def _data(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(batch, 3, generator=g, dtype=F64)
    y = x[:, :2] * 0.5 + (0.1 + x[:, :1].abs()) * torch.randn(batch, 2, generator=g, dtype=F64)
    y[1, 0] = float("nan")  # a missing target on rank 0's shard
    return x, y


def _backward(net, x: torch.Tensor, y: torch.Tensor) -> None:
    net(x)
    OutputUpdater().update_heteros(net.output_z_buffer, y, net.input_delta_z_buffer)
    net.backward()


def _shard(t: torch.Tensor, rank: int, sizes: list[int]) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def _both_modes(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    out = {}
    sizes = [5, 11]  # uneven local batches
    ddp, reference = DDPSequential(_net(seed=rank), config, average=False), _net(seed=0)
    worst = 0.0
    for step in range(3):
        x, y = _data(step, sum(sizes))
        _backward(ddp, _shard(x, rank, sizes), _shard(y, rank, sizes))
        ddp.step()
        _backward(reference, x, y)
        reference.step()
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    ddp.check_replicas()
    out["sum"] = dict(worst=worst, fingerprint=ddp.params_fingerprint())

    sizes = [8, 8]  # pytagi's average: mean of the per-rank deltas, the cap of the local batch
    ddp, reference = DDPSequential(_net(seed=rank), config, average=True), _net(seed=0)
    worst = 0.0
    for step in range(3):
        x, y = _data(step, sum(sizes))
        _backward(ddp, _shard(x, rank, sizes), _shard(y, rank, sizes))
        ddp.step()
        deltas = []
        for r in range(world_size):
            _backward(reference, _shard(x, r, sizes), _shard(y, r, sizes))
            deltas.append(reference.flat_deltas.clone())
        reference.flat_deltas.copy_(sum(deltas) / world_size)
        reference.cap_batch_size = sizes[0]
        reference.step()
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    ddp.check_replicas()
    out["average"] = dict(worst=worst, fingerprint=ddp.params_fingerprint())
    return out


def test_heteros_update_is_data_parallel_in_both_modes():
    results = run_world(_both_modes, world_size=2, timeout_s=120)
    for mode in ("sum", "average"):
        assert results[0][mode]["fingerprint"] == results[1][mode]["fingerprint"], mode
        for r in results:
            assert r[mode]["worst"] < 1e-12, (mode, r[mode]["worst"])
