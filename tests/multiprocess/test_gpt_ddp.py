"""torch-gpt on 2 real gloo ranks equals one process on the same global batch (float64): the
per-token mean loss of each rank's share, averaged by DDP, is the global batch's mean, since
every share holds as many tokens (docs/design.md, 1 (equivalence))."""

from __future__ import annotations

import copy
import functools
from datetime import timedelta

import pytest
import torch

from dptrain.learners import TorchLearner
from dptrain.models.gpt import GPT, GPTConfig
from dptrain.runtime import DistEnv, Runtime
from tests._world import run_world

pytestmark = pytest.mark.dist
CONFIG = GPTConfig(vocab_size=13, block_size=8, layers=2, heads=2, width=16)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).double()


def _batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.block_size + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _train(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank,
                  local_world_size=world_size, node_rank=0, master_addr="127.0.0.1",
                  master_port=0, launcher="env")
    learner = TorchLearner(_gpt(), torch.nn.CrossEntropyLoss(), ADAMW, max_grad_norm=1.0,
                           per_position=True)
    learner.setup(Runtime(env, "gloo", torch.device("cpu"), timedelta(seconds=30)))
    share = 8 // world_size
    for step in range(3):
        x, y = _batch(step)
        mine = slice(rank * share, (rank + 1) * share)
        learner.train_step((x[mine], y[mine]))
    return learner.model_state_dict()


def test_two_ranks_equal_one_process_with_the_same_global_batch_in_float64():
    model = copy.deepcopy(_gpt())
    optimizer = ADAMW(model.parameters())
    for step in range(3):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x).reshape(-1, CONFIG.vocab_size),
                                          y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    want = model.state_dict()
    ranks = run_world(_train, world_size=2, timeout_s=120)
    for rank, got in enumerate(ranks):
        assert set(got) <= set(want)
        for name, value in got.items():
            assert torch.allclose(value, want[name], rtol=0, atol=1e-12), (rank, name)
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
