"""DDPSequential with BatchNorm and residual blocks on 2 real gloo ranks: synchronised
statistics make sum mode step exactly like one process on the global batch (uneven shards
included, and a rank without a sample); unsynchronised running statistics are averaged;
replicas stay bit-identical, running statistics included; average mode caps alike on every rank
and divides by its `average_over`."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.errors import RankFailure
from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, HRCSoftmax, LayerBlock, Linear,
                          OutputUpdater, ReLU, ResNetBlock, Sequential, manual_seed)
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64


def _conv_resnet(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(
        Conv2d(2, 4, 3, padding=1), BatchNorm2d(4), ReLU(),
        ResNetBlock(LayerBlock(Conv2d(4, 4, 3, padding=1), BatchNorm2d(4), ReLU(),
                               Conv2d(4, 4, 3, padding=1), BatchNorm2d(4))),
        ReLU(),
        ResNetBlock(LayerBlock(Conv2d(4, 6, 3, stride=2, padding=1), BatchNorm2d(6), ReLU()),
                    LayerBlock(Conv2d(4, 6, 1, stride=2), BatchNorm2d(6))),
        AvgPool2d(3), Linear(6, 3), dtype=F64)


def _fnn_bn(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(5, 8), BatchNorm2d(8), ReLU(),
                      ResNetBlock(LayerBlock(Linear(8, 8), BatchNorm2d(8), ReLU(), Linear(8, 8))),
                      Linear(8, 3), dtype=F64)


NETS = {"fnn_bn": (_fnn_bn, (5,)), "conv_resnet": (_conv_resnet, (2, 5, 5))}


def _data(step: int, batch: int, sample: tuple[int, ...]):
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn((batch,) + sample, generator=g, dtype=F64),
            torch.randn(batch, 3, generator=g, dtype=F64))


def _step(net, x, y, updater) -> None:
    net(x)
    updater.update(net.output_z_buffer, y, 0.2, net.input_delta_z_buffer)
    net.backward()
    net.step()


def _shard(t: torch.Tensor, rank: int, sizes: list[int]) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def _sync_equivalence(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    updater, out = OutputUpdater(), {}
    for name, (build, sample) in NETS.items():
        # uneven; one sample on a rank (FC BatchNorm); none on a rank (an epoch's last batch
        # split unevenly: it takes part with a count of 0 and zero deltas)
        for sizes in ([4, 4], [1, 6], [5, 2], [3, 0], [0, 5]):
            ddp = DDPSequential(build(seed=rank), config)  # sum mode: sync_batchnorm on
            reference = build(seed=0)
            worst = 0.0
            for step in range(3):
                x, y = _data(step, sum(sizes), sample)
                _step(ddp, _shard(x, rank, sizes), _shard(y, rank, sizes), updater)
                _step(reference, x, y, updater)
                for ours, theirs in ((ddp.model.flat_params, reference.flat_params),
                                     (ddp.model.flat_state, reference.flat_state)):
                    worst = max(worst, (ours - theirs).abs().max().item())
            ddp.check_replicas()
            ddp.eval()
            x, _ = _data(99, 4, sample)
            eval_gap = (ddp(x)[0] - reference.eval()(x)[0]).abs().max().item()
            out[f"{name} {sizes}"] = dict(
                worst=worst, eval_gap=eval_gap, collectives=ddp.num_collectives,
                tracked=ddp.model.state_dict()["1.num_batches_tracked"].item(),
                cap=ddp.model.cap_batch_size, sync=ddp.sync_batchnorm,
                prints=(ddp.params_fingerprint(), ddp.state_fingerprint()))
    return out


def test_sum_mode_with_synchronised_batchnorm_equals_one_process():
    """Contract 1 with BatchNorm: global batch statistics in every training forward, so a conv
    ResNet with BatchNorm (and a flat one) on 2 ranks steps like one process on the global
    batch — parameters, running statistics and the eval forward, uneven shards included, and a
    rank with an empty batch; contract 2: ranks seeded differently end bit-identical, state
    included."""
    results = run_world(_sync_equivalence, world_size=2, timeout_s=120)
    for r in results:
        for key, got in r.items():
            assert got["worst"] < 1e-10, (key, got["worst"])
            assert got["eval_gap"] < 1e-10, (key, got["eval_gap"])
            assert got["collectives"] == 3, "one all-reduce per step for the deltas"
            assert got["tracked"] == 3 and got["sync"] and got["cap"] is None
    for key in results[0]:
        assert results[0][key]["prints"] == results[1][key]["prints"], key


def _local_statistics(rank: int, world_size: int) -> dict:
    """sync_batchnorm=False (pytagi): local statistics; the running statistics are averaged
    over the ranks after each step. Reference: each shard at the same parameters, deltas
    summed, states averaged."""
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    updater, sizes = OutputUpdater(), [3, 5]
    ddp = DDPSequential(_fnn_bn(seed=rank), config, sync_batchnorm=False)
    reference, probe = _fnn_bn(seed=0), _fnn_bn(seed=0)
    worst = 0.0
    for step in range(3):
        x, y = _data(step, sum(sizes), (5,))
        _step(ddp, _shard(x, rank, sizes), _shard(y, rank, sizes), updater)
        total, states = torch.zeros_like(reference.flat_deltas), []
        for r in range(world_size):
            probe.load_state_dict(reference.state_dict())
            probe(_shard(x, r, sizes))
            updater.update(probe.output_z_buffer, _shard(y, r, sizes), 0.2,
                           probe.input_delta_z_buffer)
            probe.backward()
            total += probe.flat_deltas
            states.append(probe.flat_state.clone())
        reference.flat_deltas.copy_(total)
        reference.flat_state.copy_(sum(states) / world_size)
        reference.cap_batch_size = sum(sizes)
        reference.step()
        for ours, theirs in ((ddp.model.flat_params, reference.flat_params),
                             (ddp.model.flat_state, reference.flat_state)):
            worst = max(worst, (ours - theirs).abs().max().item())
    ddp.check_replicas()
    return {"worst": worst, "collectives": ddp.num_collectives,
            "print": ddp.state_fingerprint()}


def _tamper_and_modes(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    out = {}
    ddp = DDPSequential(_fnn_bn(seed=rank), config)
    x, y = _data(0, 6, (5,))
    _step(ddp, x[rank * 3:(rank + 1) * 3], y[rank * 3:(rank + 1) * 3], OutputUpdater())
    ddp.check_replicas()
    if rank == 1:
        ddp.model.layers[3].main.layers[1].var_ra[0] += 1e-9  # a silent divergence, nested
    try:
        ddp.check_replicas()
    except RankFailure as err:
        out["diverged"] = str(err)
    # sync_batchnorm with average=True: allowed (global statistics, averaged deltas).
    both = DDPSequential(_fnn_bn(seed=rank), config, average=True, sync_batchnorm=True)
    _step(both, x[rank * 3:(rank + 1) * 3], y[rank * 3:(rank + 1) * 3], OutputUpdater())
    both.check_replicas()
    out["modes"] = (repr(both), DDPSequential(_fnn_bn(0), config, average=True).sync_batchnorm)
    out["local"] = _local_statistics(rank, world_size)
    return out


def test_local_statistics_tampering_and_modes():
    """sync_batchnorm=False averages the running statistics (bit-identical ranks); a rank whose
    running statistics were tampered with is named; sync with average mode is allowed."""
    results = run_world(_tamper_and_modes, world_size=2, timeout_s=120)
    for r in results:
        assert r["local"]["worst"] < 1e-12 and r["local"]["collectives"] == 3
    assert results[0]["local"]["print"] == results[1]["local"]["print"]
    for r in results:
        assert r["diverged"] == ("replicas diverged: rank(s) [1] hold running statistics "
                                 "(BatchNorm state) that differ from rank 0's")
        assert "average, sync_batchnorm" in r["modes"][0]
        assert r["modes"][1] is False  # average mode defaults to pytagi's local statistics


def _plain_net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(8, 16), ReLU(), LayerBlock(Linear(16, 16), ReLU()), Linear(16, 11),
                      dtype=F64)


def _average_uneven(rank: int, world_size: int) -> dict:
    """Average mode with shards on either side of a cap threshold (1 vs 2: c = 0.1 vs 2;
    255 vs 256: c = 2 vs 3): every rank caps with c(⌊B_global/N⌋), so the replicas stay
    identical and follow (1/N) Σ_r Δ_r capped once. N is `average_over` when given (a run
    resumed on another world size keeps its own), and a rank may hold no sample (a last batch
    of fewer samples than N caps with c(1))."""
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    hrc, updater, out = HRCSoftmax(10), OutputUpdater(), {}
    for sizes, over in (([1, 2], None), ([255, 256], None), ([3, 0], None), ([1, 0], None),
                        ([4, 3], 3)):
        ddp = DDPSequential(_plain_net(seed=rank), config, average=True, average_over=over)
        n = over or world_size
        reference, probe = _plain_net(seed=0), _plain_net(seed=0)
        worst = 0.0
        for step in range(3):
            g = torch.Generator().manual_seed(300 + step)
            x = torch.randn(sum(sizes), 8, generator=g, dtype=F64)
            labels = torch.randint(0, 10, (sum(sizes),), generator=g)
            obs, idx = hrc.encode(_shard(labels, rank, sizes), dtype=F64)
            ddp(_shard(x, rank, sizes))
            updater.update_using_indices(ddp.output_z_buffer, obs, 0.05 ** 2, idx,
                                         ddp.input_delta_z_buffer)
            ddp.backward()
            ddp.step()
            total = torch.zeros_like(reference.flat_deltas)
            for r in (r for r in range(world_size) if sizes[r]):  # an empty shard adds nothing
                probe.load_state_dict(reference.state_dict())
                probe(_shard(x, r, sizes))
                obs, idx = hrc.encode(_shard(labels, r, sizes), dtype=F64)
                updater.update_using_indices(probe.output_z_buffer, obs, 0.05 ** 2, idx,
                                             probe.input_delta_z_buffer)
                probe.backward()
                total += probe.flat_deltas
            reference.flat_deltas.copy_(total / n)
            reference.cap_batch_size = max(1, sum(sizes) // n)
            reference.step()
            worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
        ddp.check_replicas()
        out[f"{sizes} over {n}"] = {"worst": worst, "cap": ddp.model.cap_batch_size}
    return out


def test_average_mode_caps_alike_on_every_rank_with_uneven_shards():
    for r in run_world(_average_uneven, world_size=2, timeout_s=120):
        for sizes, got in r.items():
            assert got["worst"] < 1e-12, (sizes, got["worst"])
            assert got["cap"] is None, "cap_batch_size is scoped to the step"
