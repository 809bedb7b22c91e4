"""DDPSequential on 2 real gloo ranks (docs/design.md contracts 1, 2; docs/tagi.md)."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.errors import ConfigError, RankFailure
from dptrain.tagi import HRCSoftmax, Linear, OutputUpdater, ReLU, Sequential, manual_seed
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

SIGMA_V = 0.05


def _net(seed: int = 0, nested: bool = True) -> Sequential:
    manual_seed(seed)
    inner = Sequential(Linear(16, 16), ReLU())
    layers = [Linear(8, 16), ReLU(), inner, Linear(16, 11)] if nested else \
        [Linear(8, 16), ReLU(), Linear(16, 11)]
    return Sequential(*layers, dtype=torch.float64)


def _data(step: int, global_batch: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(global_batch, 8, generator=g, dtype=torch.float64), \
        torch.randint(0, 10, (global_batch,), generator=g)


def _train_step(net, x, labels, hrc, updater) -> None:
    net(x)
    obs, idx = hrc.encode(labels, dtype=torch.float64)
    updater.update_using_indices(net.output_z_buffer, obs, SIGMA_V**2, idx,
                                 net.input_delta_z_buffer)
    net.backward()
    net.step()


def _shard(t: torch.Tensor, rank: int, sizes: list[int]) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def _sum_mode_equivalence(rank: int, world_size: int) -> dict:
    hrc, updater = HRCSoftmax(10), OutputUpdater()
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    out = {}
    # (16, 16): cap regime unchanged (c=2 for 16 and 32); (128, 128): local c=2 but global c=3;
    # (5, 11): uneven local batches.
    for sizes in ([16, 16], [128, 128], [5, 11]):
        # Rank 1 starts from other weights: the broadcast must make it rank 0's.
        ddp = DDPSequential(_net(seed=rank), config, average=False)
        reference = _net(seed=0)
        worst = 0.0
        for step in range(4):
            x, labels = _data(step, sum(sizes))
            _train_step(ddp, _shard(x, rank, sizes), _shard(labels, rank, sizes), hrc, updater)
            _train_step(reference, x, labels, hrc, updater)
            worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
        out[str(sizes)] = dict(worst=worst, collectives=ddp.num_collectives,
                               global_batch=ddp.global_batch_size,
                               fingerprint=ddp.params_fingerprint())
        ddp.check_replicas()
    return out


def test_sum_mode_equals_one_process_on_the_global_batch():
    """Contract 1: N ranks x B in sum mode == 1 process x N·B, with the cap of the global batch
    (also when local and global batches fall in different cap regimes, and uneven shards);
    contract 2: replicas bit-identical, nested blocks included in broadcast and reduce."""
    results = run_world(_sum_mode_equivalence, world_size=2, timeout_s=120)
    for r in results:
        for sizes, got in r.items():
            assert got["worst"] < 1e-12, (sizes, got["worst"])
            assert got["collectives"] == 4, "one all-reduce per step"
            assert got["global_batch"] == sum(eval(sizes))
    for sizes in results[0]:
        assert results[0][sizes]["fingerprint"] == results[1][sizes]["fingerprint"]


def _average_mode_formula(rank: int, world_size: int) -> dict:
    hrc, updater = HRCSoftmax(10), OutputUpdater()
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    ddp = DDPSequential(_net(seed=rank), config, average=True)
    reference, probe = _net(seed=0), _net(seed=0)
    local = 128  # c(128) = 2 locally, c(256) = 3 globally: average mode uses the mean local cap
    worst = 0.0
    for step in range(3):
        x, labels = _data(step, local * world_size)
        _train_step(ddp, x[rank * local:(rank + 1) * local],
                    labels[rank * local:(rank + 1) * local], hrc, updater)
        # Reference: (1/N) Σ_r Δ_r from each shard at the same parameters, local cap.
        total = torch.zeros_like(reference.flat_deltas)
        for r in range(world_size):
            probe.load_state_dict(reference.state_dict())
            probe(x[r * local:(r + 1) * local])
            obs, idx = hrc.encode(labels[r * local:(r + 1) * local], dtype=torch.float64)
            updater.update_using_indices(probe.output_z_buffer, obs, SIGMA_V**2, idx,
                                         probe.input_delta_z_buffer)
            probe.backward()
            total += probe.flat_deltas
        reference.flat_deltas.copy_(total / world_size)
        reference.cap_batch_size = local
        reference.step()
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    return {"worst": worst}


def test_average_mode_applies_the_mean_delta_with_the_local_cap():
    """docs/tagi.md: average mode (pytagi's) applies (1/N) Σ_r Δ_r, capped with c(⌊B_global/N⌋),
    which is c(B_local) for even shards (uneven shards: test_tagi_ddp_norm.py)."""
    for r in run_world(_average_mode_formula, world_size=2, timeout_s=120):
        assert r["worst"] < 1e-12


def _mismatch_and_divergence(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    out = {}
    wrong = Sequential(Linear(8, 16 if rank == 0 else 17), ReLU(), Linear(16 if rank == 0 else 17,
                                                                         11))
    try:
        DDPSequential(wrong, config)
    except ConfigError as err:
        out["mismatch"] = str(err)
    ddp = DDPSequential(_net(nested=False), config)
    if rank == 1:
        ddp.model.flat_params[0, 0] += 1e-6  # a silent divergence
    try:
        ddp.check_replicas()
    except RankFailure as err:
        out["diverged"] = str(err)
    return out


def test_mismatched_models_and_diverged_replicas_are_named():
    for r in run_world(_mismatch_and_divergence, world_size=2, timeout_s=90):
        assert "rank 1 built a different model than rank 0" in r["mismatch"]
        assert "first difference: rank 0 ('0.mu_w', (16, 8)) vs rank 1 ('0.mu_w', (17, 8))" \
            in r["mismatch"]
        assert "replicas diverged: rank(s) [1]" in r["diverged"]


def test_world_size_one_runs_without_a_process_group():
    hrc, updater = HRCSoftmax(10), OutputUpdater()
    ddp = DDPSequential(_net(), DDPConfig(device_ids=[], backend="gloo"))
    reference = _net()
    x, labels = _data(0, 8)
    _train_step(ddp, x, labels, hrc, updater)
    _train_step(reference, x, labels, hrc, updater)
    assert torch.equal(ddp.model.flat_params, reference.flat_params)
    assert ddp.num_collectives == 0 and not torch.distributed.is_initialized()
    assert ddp.model.cap_batch_size is None  # scoped to the step: the model alone is unaffected
    ddp.check_replicas()
