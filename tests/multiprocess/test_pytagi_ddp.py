"""dptrain.pytagi.nn.DDPSequential on 2 real gloo ranks (issue 29): pytagi's loop with flat
numpy arrays, averaging by default as pytagi does; the step equals dptrain.tagi's average mode
on the same shards, and the replicas stay identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dptrain.pytagi as pytagi
from dptrain import tagi
from dptrain.pytagi import Utils
from dptrain.pytagi.nn import DDPConfig, DDPSequential, Linear, OutputUpdater, ReLU, Sequential
from tests._world import run_world

pytestmark = pytest.mark.dist

BATCH, STEPS = 6, 3


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.normal(size=(2 * BATCH, 4)).astype(np.float32), \
        rng.integers(0, 10, size=2 * BATCH).astype(np.int32)


def _pytagi_ranks(rank: int, world_size: int) -> dict:
    pytagi.manual_seed(0)
    net = DDPSequential(Sequential(Linear(4, 16), ReLU(), Linear(16, 11)),
                        DDPConfig(device_ids=[], backend="gloo", rank=rank,
                                  world_size=world_size))
    utils, updater = Utils(), OutputUpdater("cpu")
    var_y = np.full(BATCH * 4, 0.05**2, dtype=np.float32)
    for step in range(STEPS):
        x, labels = _data(step)
        shard = slice(rank * BATCH, (rank + 1) * BATCH)
        mu, _ = net(x[shard].ravel())  # flat, as pytagi's loops pass it
        y, y_idx, _ = utils.label_to_obs(labels[shard], 10)
        updater.update_using_indices(net.output_z_buffer, y, var_y, y_idx,
                                     net.input_delta_z_buffer)
        net.backward()
        net.step()
    net._engine.check_replicas()
    return {"average": net.average, "flat_out": mu.shape,
            "params": net.model.model.flat_params.clone()}


def _engine_reference() -> torch.Tensor:
    """One process replaying both shards with the average-mode formula: the mean of the two
    shards' deltas, stepped with the cap of one shard."""
    tagi.manual_seed(0)
    net = tagi.Sequential(tagi.Linear(4, 16), tagi.ReLU(), tagi.Linear(16, 11))
    hrc, updater = tagi.HRCSoftmax(10), tagi.OutputUpdater()
    for step in range(STEPS):
        x, labels = _data(step)
        deltas = []
        for rank in range(2):
            shard = slice(rank * BATCH, (rank + 1) * BATCH)
            net(torch.from_numpy(x[shard]))
            obs, idx = hrc.encode(torch.from_numpy(labels[shard]).long())
            updater.update_using_indices(net.output_z_buffer, obs, 0.05**2, idx,
                                         net.input_delta_z_buffer)
            net.backward()
            deltas.append(net.flat_deltas.clone())
        net.flat_deltas.copy_((deltas[0] + deltas[1]) / 2)
        net.step()
    return net.flat_params


def test_pytagi_ddp_averages_and_matches_the_engines_average_mode():
    results = run_world(_pytagi_ranks, world_size=2, timeout_s=120)
    reference = _engine_reference()
    for rank, result in enumerate(results):
        assert result["average"] is True and result["flat_out"] == (BATCH * 11,)
        torch.testing.assert_close(result["params"], reference, rtol=1e-5, atol=1e-6,
                                   msg=f"rank {rank}")
