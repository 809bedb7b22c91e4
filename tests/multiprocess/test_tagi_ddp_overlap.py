"""The overlapped all-reduce of DDPSequential on 2 real gloo ranks: reducing the deltas bucket
by bucket during backward gives the same bits as one all-reduce in step(), every bucket is
reduced, and a failed or missing peer during an overlapped step is a named error."""

from __future__ import annotations

import time

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.errors import RankFailure
from dptrain.tagi import LayerBlock, Linear, OutputUpdater, ReLU, Sequential, manual_seed
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world
from tests.multiprocess.test_tagi_ddp_norm import _conv_resnet, _fnn_bn

pytestmark = pytest.mark.dist

F32, F64 = torch.float32, torch.float64
SIZES = [3, 5]  # uneven local batches


def _fnn(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(5, 16), ReLU(), LayerBlock(Linear(16, 16), ReLU()), Linear(16, 3),
                      dtype=F64)


# name: (builder, sample shape, DDPSequential options)
CASES = {
    "fnn sum": (_fnn, (5,), {}),
    "fnn average": (_fnn, (5,), {"average": True}),
    "fnn+batchnorm average, local statistics": (_fnn_bn, (5,), {"average": True}),
    "conv resnet+batchnorm sum, synchronised": (_conv_resnet, (2, 5, 5), {}),
    "conv resnet+batchnorm sum, local statistics": (_conv_resnet, (2, 5, 5),
                                                    {"sync_batchnorm": False}),
}


def _data(step: int, batch: int, sample: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(400 + step)
    return (torch.randn((batch,) + sample, generator=g, dtype=F64).to(dtype),
            torch.randn(batch, 3, generator=g, dtype=F64).to(dtype))


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SIZES[:rank])
    return t[start:start + SIZES[rank]]


def _step(net, x, y, updater) -> None:
    net(x)
    updater.update(net.output_z_buffer, y, 0.2, net.input_delta_z_buffer)
    net.backward()
    net.step()


def _bits(net) -> tuple[torch.Tensor, torch.Tensor]:
    return net.model.flat_params.clone(), net.model.flat_state.clone()


def _overlap_against_one_bucket(rank: int, world_size: int) -> dict:
    """Per case, in float32: overlap off; overlap with one layer per bucket (bucket_bytes=1);
    overlap with the default buckets. Same seeds, same shards, 3 steps."""
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    updater, out = OutputUpdater(), {}
    for name, (build, sample, options) in CASES.items():
        nets = {label: DDPSequential(build(seed=rank).to(F32), config, overlap=overlap,
                                     **options, **extra)
                for label, overlap, extra in (("off", False, {}), ("per layer", True,
                                                                  {"bucket_bytes": 1}),
                                              ("default", True, {}))}
        for step in range(3):
            x, y = _data(step, sum(SIZES), sample, F32)
            for net in nets.values():
                _step(net, _shard(x, rank), _shard(y, rank), updater)
        off_params, off_state = _bits(nets["off"])
        out[name] = {
            label: dict(same_params=torch.equal(_bits(net)[0], off_params),
                        same_state=torch.equal(_bits(net)[1], off_state),
                        buckets=net.buckets, collectives=net.num_collectives,
                        parametric_layers=sum(e > s for s, e in
                                              net.model.layer_delta_columns()),
                        columns=net.model.flat_params.shape[1])
            for label, net in nets.items()}
        out[name]["prints"] = nets["per layer"].params_fingerprint() + \
            nets["per layer"].state_fingerprint()
        nets["per layer"].check_replicas()
    return out


def test_overlapped_all_reduce_gives_the_bits_of_one_all_reduce():
    """Bucketing changes nothing: every per-element sum is the same two operands, so overlap on
    (one bucket per layer, or the default buckets) steps to exactly the parameters and running
    statistics of overlap off, in sum and average mode, with synchronised and local BatchNorm,
    uneven shards; and the buckets tile the deltas from the output side."""
    results = run_world(_overlap_against_one_bucket, world_size=2, timeout_s=120)
    for r in results:
        for name, got in r.items():
            for label in ("per layer", "default"):
                assert got[label]["same_params"] and got[label]["same_state"], (name, label)
            per_layer = got["per layer"]
            buckets = per_layer["buckets"]
            assert len(buckets) == per_layer["parametric_layers"] > 1, name
            assert per_layer["collectives"] == 3 * len(buckets), "one all-reduce per bucket"
            assert got["off"]["collectives"] == 3 and len(got["off"]["buckets"]) == 1
            # From the output side, contiguous, every column once.
            assert buckets[0][1] == per_layer["columns"] and buckets[-1][0] == 0, name
            assert all(a[0] == b[1] for a, b in zip(buckets, buckets[1:])), name
    for name in results[0]:
        assert results[0][name]["prints"] == results[1][name]["prints"], name


def _sum_mode_per_layer_buckets(rank: int, world_size: int) -> dict:
    """Sum mode with one bucket per layer equals one process on the global batch (float64):
    a bucket left out would leave that layer's deltas local and break the equality."""
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    updater, out = OutputUpdater(), {}
    for name in ("fnn sum", "conv resnet+batchnorm sum, synchronised"):
        build, sample, _ = CASES[name]
        ddp = DDPSequential(build(seed=rank), config, overlap=True, bucket_bytes=1)
        reference = build(seed=0)
        worst = 0.0
        for step in range(3):
            x, y = _data(step, sum(SIZES), sample, F64)
            _step(ddp, _shard(x, rank), _shard(y, rank), updater)
            _step(reference, x, y, updater)
            for ours, theirs in ((ddp.model.flat_params, reference.flat_params),
                                 (ddp.model.flat_state, reference.flat_state)):
                if ours.numel():
                    worst = max(worst, (ours - theirs).abs().max().item())
        out[name] = {"worst": worst, "buckets": len(ddp.buckets)}
    return out


def test_sum_mode_with_one_bucket_per_layer_equals_one_process():
    for r in run_world(_sum_mode_per_layer_buckets, world_size=2, timeout_s=120):
        for name, got in r.items():
            assert got["buckets"] > 1 and got["worst"] < 1e-10, (name, got)


def _peer_gone_mid_backward(rank: int, world_size: int, how: str) -> str | None:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    ddp = DDPSequential(_fnn(seed=0), config, overlap=True, bucket_bytes=1)
    x, y = _data(0, sum(SIZES), (5,), F64)
    ddp(_shard(x, rank))
    OutputUpdater().update(ddp.output_z_buffer, _shard(y, rank), 0.2, ddp.input_delta_z_buffer)
    if rank == 1:
        if how == "dies":  # its connections close, as when the process dies
            torch.distributed.destroy_process_group()
        else:  # never arrives: rank 0 waits out the process group's timeout (5 s)
            time.sleep(7)
        return None
    try:
        ddp.backward()
        ddp.step()
    except RankFailure as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_peer_lost_during_the_overlapped_all_reduce_is_a_named_error(how):
    """Contract 4 with asynchronous collectives: waiting for a bucket fails (the peer closed
    its connections, or the process group's timeout ran out) and becomes RankFailure naming
    the bucket; nothing hangs."""
    start = time.monotonic()
    message = run_world(_peer_gone_mid_backward, how, world_size=2, timeout_s=60,
                        group_timeout_s=5)[0]
    assert message.startswith("rank 0 of 2: all_reduce(tagi deltas, bucket "), message
    assert "HINT:" in message
    assert time.monotonic() - start < 45
