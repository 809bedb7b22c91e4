"""Frozen parameters (`dptrain train --freeze`) on 2 real gloo ranks, DDP and FSDP2: out of the
optimizer and of the gradient reduction, unchanged after training, and the trained ones equal
one process on the global batch with the same parameters frozen (docs/design.md, 1)."""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
import torch
from torch import nn

from dptrain.runtime import DistEnv, Runtime
from dptrain.learners import TorchLearner
from dptrain.train.init_from import freeze
from tests._world import run_world

pytestmark = pytest.mark.dist
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    freeze(model, "0,2")
    return model


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _checks(rank: int, world_size: int) -> dict:
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank,
                  local_world_size=world_size, node_rank=0, master_addr="127.0.0.1",
                  master_port=0, launcher="env")
    runtime = Runtime(env, "gloo", torch.device("cpu"), timedelta(seconds=30))
    out = {}
    for strategy in ("ddp", "fsdp"):
        learner = TorchLearner(_model(), nn.MSELoss(), ADAM, strategy=strategy)
        learner.setup(runtime)
        reduced: list[int] = []
        if strategy == "ddp":
            def hook(state, bucket):
                reduced.extend(p.numel() for p in bucket.parameters())
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                    allreduce_hook,
                )
                return allreduce_hook(None, bucket)
            learner.wrapped.register_comm_hook(None, hook)
        for step in range(3):
            x, y = _data(step)
            learner.train_step((x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]))
        out[strategy] = {
            "state": learner.model_state_dict(),
            "optimized": sum(p.numel() for g in learner.optimizer.param_groups
                             for p in g["params"]),
            "frozen_grads": [p.grad is None for n, p in learner.module.named_parameters()
                             if n.startswith(("0.", "2."))],
            "reduced": sum(reduced) // 3 if strategy == "ddp" else None}
    return out


def test_frozen_parameters_stay_out_of_the_optimizer_and_the_all_reduce():
    reference = _model()
    optimizer = ADAM([p for p in reference.parameters() if p.requires_grad])
    for step in range(3):
        x, y = _data(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    start = _model().state_dict()
    expected = reference.state_dict()
    head = 8 * 3 + 3
    for rank, result in enumerate(run_world(_checks, world_size=2, timeout_s=120)):
        for strategy in ("ddp", "fsdp"):
            got = result[strategy]
            where = f"rank {rank}, {strategy}"
            assert all(got["frozen_grads"]), where
            for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
                assert torch.equal(got["state"][name], start[name]), (where, name)
            for name in ("4.weight", "4.bias"):
                torch.testing.assert_close(got["state"][name], expected[name], rtol=1e-5,
                                           atol=1e-6, msg=where)
        assert result["ddp"]["optimized"] == head
        assert result["ddp"]["reduced"] == head  # only the head's gradients are all-reduced
        assert result["fsdp"]["optimized"] <= head
