"""MultiheadAttention and RMSNorm under DDPSequential on 2 real gloo ranks (docs/design.md
contracts 1, 2; docs/tagi.md, MultiheadAttention and RMSNorm)."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import Linear, MultiheadAttention, RMSNorm, Sequential, manual_seed
from tests._world import run_world
from tests.multiprocess.test_tagi_ddp_layers import _sum_mode

pytestmark = pytest.mark.dist

F64 = torch.float64


def _transformer(seed: int) -> Sequential:
    """4 positions of 4 features, 2 query heads sharing 1 key/value head, RoPE."""
    manual_seed(seed)
    return Sequential(Linear(4, 16), MultiheadAttention(4, 2, 1), RMSNorm(4), Linear(16, 3),
                      dtype=F64)


def _world(rank: int, world_size: int) -> dict:
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    return _sum_mode(rank, config, "labels", _transformer)


def test_sum_mode_equals_one_process_with_attention_and_rmsnorm():
    """Contract 1: 2 ranks in sum mode (local batches 3 and 5) step like one process on the
    global batch of 8 (float64); bucketed overlap gives the same bits; contract 2: replicas
    bit-identical."""
    results = run_world(_world, world_size=2, timeout_s=120)
    for r in results:
        assert r["worst"] < 1e-12 and r["global_batch"] == 8, r
        assert r["overlap_equal"]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
