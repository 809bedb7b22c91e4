"""Embedding and SLSTM under DDPSequential on 2 real gloo ranks (docs/design.md contracts 1, 2;
docs/tagi.md, Embedding and SLSTM and the smoother)."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import (SLSTM, Embedding, Linear, OutputUpdater, ReLU, Sequential, SLinear,
                          manual_seed)
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64


def _embedding_net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Embedding(7, 3, input_size=2, padding_idx=0), Linear(6, 4), ReLU(),
                      Linear(4, 2), dtype=F64)


def _slstm_net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(SLSTM(2, 3, 1), SLSTM(3, 3, 1), SLinear(3, 1), dtype=F64)


def _step(net, x, y) -> None:
    net(x)
    OutputUpdater().update(net.output_z_buffer, y, 0.1, net.input_delta_z_buffer)
    net.backward()
    net.step()


def _worst(ddp: DDPSequential, reference: Sequential) -> float:
    return (ddp.model.flat_params - reference.flat_params).abs().max().item()


def _embedding_sum_mode(rank: int, config: DDPConfig) -> dict:
    """Uneven shards (3 + 5 samples) of ids with repeats across ranks and the padding id."""
    sizes = [3, 5]
    start = sum(sizes[:rank])
    ddp = DDPSequential(_embedding_net(seed=rank), config)  # rank 1's table: overwritten
    # Every layer its own bucket, sent while the backward runs: the same sums, bitwise.
    overlapped = DDPSequential(_embedding_net(seed=rank), config, overlap=True, bucket_bytes=1)
    reference = _embedding_net(seed=0)
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        ids = torch.randint(0, 7, (8, 2), generator=g).to(F64)
        y = torch.randn(8, 2, generator=g, dtype=F64)
        for net in (ddp, overlapped):
            _step(net, ids[start:start + sizes[rank]], y[start:start + sizes[rank]])
        _step(reference, ids, y)
        worst = max(worst, _worst(ddp, reference))
    ddp.check_replicas()
    return {"worst": worst, "fingerprint": ddp.params_fingerprint(),
            "overlap_equal": torch.equal(overlapped.model.flat_params, ddp.model.flat_params),
            "buckets": len(overlapped.buckets)}


def _slstm_sum_mode(rank: int, config: DDPConfig) -> dict:
    """Rank r runs series r (a batch of one); one process runs both series side by side."""
    g = torch.Generator().manual_seed(60)
    x = torch.randn(6, 2, 2, generator=g, dtype=F64)  # (T, series, features)
    y = torch.randn(6, 2, 1, generator=g, dtype=F64)
    ddp = DDPSequential(_slstm_net(seed=rank), config)
    reference = _slstm_net(seed=0)
    worst = 0.0
    for t in range(6):
        _step(ddp, x[t, rank:rank + 1], y[t, rank:rank + 1])
        _step(reference, x[t], y[t])
        worst = max(worst, _worst(ddp, reference))
    ddp.check_replicas()
    mine, theirs = ddp.smoother(), reference.smoother()
    smooth = max((a - b[:, rank:rank + 1]).abs().max().item() for a, b in zip(mine, theirs))
    states = max((getattr(ddp.model.layers[i], f"{name}_smooths")
                  - getattr(reference.layers[i], f"{name}_smooths")[:, rank:rank + 1])
                 .abs().max().item()
                 for i in (0, 1) for name in ("mu_h", "var_h", "mu_c", "var_c"))
    return {"worst": worst, "smooth": smooth, "states": states,
            "fingerprint": ddp.params_fingerprint(), "global_batch": ddp.global_batch_size}


def _sequence_layers(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    return {"embedding": _embedding_sum_mode(rank, config),
            "slstm": _slstm_sum_mode(rank, config)}


def test_sum_mode_equals_one_process_for_embedding_and_slstm():
    """Contract 1: 2 ranks in sum mode step like one process on the global batch, for an
    Embedding table (uneven shards, an id seen on both ranks adds both ranks' innovations;
    bucketed overlap gives the same bits) and
    for an SLSTM stack (each rank one series; one process the two series side by side, with
    the same smoothed states per series); contract 2: replicas bit-identical."""
    results = run_world(_sequence_layers, world_size=2, timeout_s=120)
    for r in results:
        assert r["embedding"]["worst"] < 1e-12, r["embedding"]
        assert r["embedding"]["overlap_equal"] and r["embedding"]["buckets"] == 3
        assert r["slstm"]["worst"] < 1e-12 and r["slstm"]["global_batch"] == 2, r["slstm"]
        assert r["slstm"]["smooth"] < 1e-12 and r["slstm"]["states"] < 1e-12, r["slstm"]
    for kind in ("embedding", "slstm"):
        assert results[0][kind]["fingerprint"] == results[1][kind]["fingerprint"]
