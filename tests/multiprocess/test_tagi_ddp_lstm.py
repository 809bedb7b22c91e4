"""DDPSequential with LSTM layers on 2 real gloo ranks (docs/design.md contracts 1, 2;
docs/tagi.md, LSTM): sum mode equals one process on the global batch of windows, replicas are
bit-identical, and the states an LSTM carries (batch 1, seq_len 1) stay each rank's own. The
same for a global forecasting network: a Parallel block routing each window to LSTM layers and
its series id to an Embedding."""

from __future__ import annotations

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import (LSTM, Embedding, LayerBlock, Linear, OutputUpdater, Parallel,
                          Sequential, manual_seed)
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

F64 = torch.float64


def _net(seed: int, seq_len: int = 3) -> Sequential:
    manual_seed(seed)
    return Sequential(LSTM(2, 4, seq_len), LayerBlock(LSTM(4, 4, seq_len)),
                      Linear(4 * seq_len, 1), dtype=F64)


def _embedding_net(seed: int, seq_len: int = 3) -> Sequential:
    """Windows of `seq_len` steps of 2 values through the LSTMs, the series id (last column)
    through an Embedding(3, 2), both into the head."""
    manual_seed(seed)
    lstms = LayerBlock(LSTM(2, 4, seq_len), LSTM(4, 4, seq_len))
    return Sequential(Parallel(lstms, Embedding(3, 2), input_sizes=(2 * seq_len, 1)),
                      Linear(4 * seq_len + 2, 1), dtype=F64)


def _windows(step: int, batch: int, seq_len: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(batch, seq_len, 2, generator=g, dtype=F64),
            torch.randn(batch, 1, generator=g, dtype=F64))


def _windows_with_ids(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _windows(step, batch)
    ids = torch.arange(batch, dtype=F64)[:, None] % 3
    return torch.cat([x.flatten(1), ids], 1), y


def _train_step(net, x, y) -> None:
    net(x)
    OutputUpdater().update(net.output_z_buffer, y, 0.05, net.input_delta_z_buffer)
    net.backward()
    net.step()


def _sum_mode(config: DDPConfig, rank: int) -> dict:
    out = {}
    # even, uneven, a rank without a sample; and uneven with the overlapped all-reduce; the
    # embedding network uneven and with a rank without a sample
    for sizes, overlap, embed in (([4, 4], False, False), ([3, 6], False, False),
                                  ([0, 5], False, False), ([3, 6], True, False),
                                  ([3, 6], False, True), ([0, 5], True, True)):
        net, windows = (_embedding_net, _windows_with_ids) if embed else (_net, _windows)
        # rank 1 starts elsewhere: the broadcast makes it rank 0's
        ddp = DDPSequential(net(seed=rank), config, overlap=overlap)
        reference = net(seed=0)
        worst = 0.0
        for step in range(3):
            x, y = windows(step, sum(sizes))
            start = sum(sizes[:rank])
            _train_step(ddp, x[start:start + sizes[rank]], y[start:start + sizes[rank]])
            _train_step(reference, x, y)
            worst = max(worst, (ddp.model.flat_params - reference.flat_params).abs().max().item())
        ddp.check_replicas()
        ddp.eval()
        x, _ = windows(99, 5)
        gap = (ddp(x)[0] - reference.eval()(x)[0]).abs().max().item()
        out[f"{sizes} overlap={overlap} embedding={embed}"] = dict(worst=worst, eval_gap=gap,
                                                 fingerprint=ddp.params_fingerprint())
    return out


def _carried(config: DDPConfig, rank: int) -> dict:
    ddp = DDPSequential(_net(seed=0, seq_len=1), config)
    for step in range(3):  # one sample of each rank's own series per step
        x, y = _windows(step, 2, seq_len=1)
        _train_step(ddp, x[rank:rank + 1], y[rank:rank + 1])
    ddp.check_replicas()
    carried = ddp.model.layers[0].lstm_states()[0].reshape(-1).tolist()
    ddp.reset_lstm_states()  # delegated to the model
    return dict(carried=carried, after_reset=ddp.model.layers[0].lstm_states()[0],
                fingerprint=ddp.params_fingerprint())


def _both(rank: int, world_size: int) -> tuple[dict, dict]:
    """Both checks in one world: starting a world costs more than either check."""
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    return _sum_mode(config, rank), _carried(config, rank)


@pytest.fixture(scope="module")
def world() -> list[tuple[dict, dict]]:
    return run_world(_both, world_size=2, timeout_s=120)


def test_sum_mode_with_lstms_equals_one_process_on_the_global_batch(world):
    """Contract 1 for windows of 3 steps (nothing carried): 2 ranks in sum mode == 1 process on
    the global batch (even and uneven shards, a rank without a sample, overlapped all-reduce),
    nested LSTM included, and with the LSTMs and an Embedding side by side in a Parallel block;
    contract 2: bit-identical replicas."""
    results = [sum_mode for sum_mode, _ in world]
    for r in results:
        for sizes, got in r.items():
            assert got["worst"] < 1e-12, (sizes, got["worst"])
            assert got["eval_gap"] < 1e-12, (sizes, got["eval_gap"])
    assert results[0]["[3, 6] overlap=True embedding=False"]["fingerprint"] == \
        results[0]["[3, 6] overlap=False embedding=False"]["fingerprint"], \
        "overlap changes nothing"
    for sizes in results[0]:
        assert results[0][sizes]["fingerprint"] == results[1][sizes]["fingerprint"]


def test_carried_states_are_each_ranks_own(world):
    """Batch 1, seq_len 1 on each rank: each rank's LSTM carries the states of its own shard
    (they differ between ranks), while the parameters stay bit-identical; reset_lstm_states()
    reaches the model through the wrapper."""
    results = [carried for _, carried in world]
    assert results[0]["carried"] != results[1]["carried"]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    assert all(r["after_reset"] is None for r in results)
