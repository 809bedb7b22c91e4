"""ConvTranspose2d and the softmax heads under DDPSequential on 2 real gloo ranks (docs/design.md
contracts 1, 2; docs/tagi.md, ConvTranspose2d, Softmax and ClosedFormSoftmax)."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import (AvgPool2d, ClosedFormSoftmax, Conv2d, ConvTranspose2d, Linear,
                          MixtureReLU, OutputUpdater, ReLU, Sequential, Softmax, manual_seed)
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64
SIZES = [3, 5]  # uneven local batches; the global batch is 8


def _autoencoder(seed: int) -> Sequential:
    """pytagi's autoencoder in small: 6x6 grey image → 2x3x3 code → 6x6 again."""
    manual_seed(seed)
    return Sequential(Conv2d(1, 2, 3, padding=1, in_width=6, in_height=6), MixtureReLU(),
                      AvgPool2d(2, 2),
                      ConvTranspose2d(2, 3, 3, stride=2, padding=1, padding_type=2),
                      MixtureReLU(), ConvTranspose2d(3, 1, 3, padding=1), dtype=F64)


def _classifier(seed: int, head) -> Sequential:
    manual_seed(seed)
    return Sequential(Linear(4, 8), ReLU(), Linear(8, 3), head(), dtype=F64)


def _data(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    if kind == "autoencoder":
        x = torch.rand(sum(SIZES), 1, 6, 6, generator=g, dtype=F64)
        return x, x.reshape(-1)  # the image is its own target, flat as pytagi passes it
    labels = torch.randint(0, 3, (sum(SIZES),), generator=g)
    return torch.randn(sum(SIZES), 4, generator=g, dtype=F64), \
        torch.nn.functional.one_hot(labels, 3).to(F64)


def _step(net, x, y) -> None:
    net(x)
    OutputUpdater().update(net.output_z_buffer, y, 0.05, net.input_delta_z_buffer)
    net.backward()
    net.step()


def _sum_mode(rank: int, config: DDPConfig, kind: str, build) -> dict:
    """Rank r steps on its shard, one process on the global batch; rank 1 starts from other
    parameters, which the broadcast replaces."""
    start, size = sum(SIZES[:rank]), SIZES[rank]
    ddp = DDPSequential(build(seed=rank), config)
    # Every top-level layer its own bucket, reduced while the backward runs: the same sums.
    overlapped = DDPSequential(build(seed=rank), config, overlap=True, bucket_bytes=1)
    reference = build(seed=0)
    worst = 0.0
    for step in range(3):
        x, y = _data(step, kind)
        y_local = y.reshape(sum(SIZES), -1)[start:start + size]
        for net in (ddp, overlapped):
            _step(net, x[start:start + size], y_local.reshape(-1))
        _step(reference, x, y)
        worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
    ddp.check_replicas()
    return {"worst": worst, "fingerprint": ddp.params_fingerprint(),
            "overlap_equal": torch.equal(overlapped.model.flat_params, ddp.model.flat_params),
            "global_batch": ddp.global_batch_size}


def _layers(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    return {"autoencoder": _sum_mode(rank, config, "autoencoder", _autoencoder),
            "softmax": _sum_mode(rank, config, "labels",
                                 lambda seed: _classifier(seed, Softmax)),
            "cf_softmax": _sum_mode(rank, config, "labels",
                                    lambda seed: _classifier(seed, ClosedFormSoftmax))}


def test_sum_mode_equals_one_process_for_transposed_convolutions_and_softmax_heads():
    """Contract 1: 2 ranks in sum mode (local batches 3 and 5) step like one process on the
    global batch of 8, for a Conv2d → ConvTranspose2d autoencoder (both padding types) and
    for classifiers ending in Softmax and in ClosedFormSoftmax (per-sample heads, so a
    shard's outputs are those rows of the global batch's); bucketed overlap gives the same
    bits; contract 2: replicas bit-identical."""
    results = run_world(_layers, world_size=2, timeout_s=120)
    for kind in ("autoencoder", "softmax", "cf_softmax"):
        for r in results:
            assert r[kind]["worst"] < 1e-12 and r[kind]["global_batch"] == 8, (kind, r[kind])
            assert r[kind]["overlap_equal"], kind
        assert results[0][kind]["fingerprint"] == results[1][kind]["fingerprint"], kind
