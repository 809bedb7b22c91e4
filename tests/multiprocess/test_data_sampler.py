"""ShardedSampler on 2 real ranks (one spawned gloo world for all checks, ~4 s).

Pins docs/design.md contract 5 (distributed evaluation counts every sample exactly once), the
equal-steps rule of training (a collective per step never waits for a rank that ran out), and
the data half of contract 3 (resume mid-epoch from rank 0's saved state on every rank).
"""

from __future__ import annotations

import pytest
import torch

from tests._world import run_world

pytestmark = pytest.mark.dist

LENGTHS = (1, 7, 10, 13)


def _shard_checks(rank: int, world_size: int) -> dict:
    from dptrain.data import ShardedSampler
    from dptrain.runtime import all_gather_object, all_reduce_flat, reduce_sum_count

    torch.manual_seed(100 + rank)  # different global RNG per rank must not matter
    report: dict = {"orders": {}}
    for n in LENGTHS:
        for epoch in range(3):
            train = ShardedSampler(n, seed=4)  # rank and world size from the process group
            evals = ShardedSampler(n, seed=4, mode="eval", shuffle=True)
            assert (train.rank, train.world_size) == (rank, world_size)
            train.set_epoch(epoch)
            evals.set_epoch(epoch)
            mine_train, mine_eval = list(train), list(evals)
            shards_train, shards_eval = zip(*all_gather_object((mine_train, mine_eval)))
            # train: equal counts, every sample present, padding = the start of the permutation
            assert [len(s) for s in shards_train] == [-(-n // world_size)] * world_size
            order = [s[i] for i in range(len(shards_train[0])) for s in shards_train]
            assert sorted(order[:n]) == list(range(n))
            assert order[n:] == (order[:n] * world_size)[:len(order) - n]
            # eval: disjoint ranks, each sample exactly once, and the same global permutation
            flat_eval = [i for s in shards_eval for i in s]
            assert sorted(flat_eval) == list(range(n))
            eval_order = [s[i] for i in range(len(shards_eval[0])) for s in shards_eval
                          if i < len(s)]
            assert eval_order == order[:n]
            report["orders"][n, epoch] = order
            # an exact distributed metric: (sum, count) over the eval shards
            totals = reduce_sum_count({"idx": (float(sum(mine_eval)), float(len(mine_eval)))})
            assert totals["idx"] == (float(n * (n - 1) // 2), float(n))
        assert len({tuple(report["orders"][n, e]) for e in range(3)}) == (1 if n == 1 else 3)

    # train: one collective per step never hangs because every rank takes the same steps
    sampler = ShardedSampler(13, seed=1)
    steps = 0
    for idx in sampler.batches(4):
        t = torch.tensor([float(len(idx))])
        all_reduce_flat([t])
        assert t.item() == world_size * len(idx)  # the partial last batch matches too
        steps += 1
    report["steps"] = steps
    return report


def _resume_checks(rank: int, world_size: int) -> list[int]:
    from dptrain.data import ShardedSampler
    from dptrain.runtime import all_gather_object, broadcast_object

    full = ShardedSampler(23, seed=9)
    full.set_epoch(1)
    expected = full.indices().tolist()
    run = ShardedSampler(23, seed=9)
    run.set_epoch(1)
    batches = run.batches(3)
    seen = torch.cat([next(batches), next(batches)]).tolist()
    state = broadcast_object(run.state_dict())  # the checkpoint holds rank 0's state
    resumed = ShardedSampler(23, seed=0)  # a fresh process: the seed comes from the state
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    rest = [i for idx in resumed.batches(3) for i in idx.tolist()]
    assert seen + rest == expected, (seen, rest, expected)
    everything = all_gather_object(seen + rest)
    union = [i for part in everything for i in part]
    assert len(union) == 24 and set(union) == set(range(23))  # one sample padded
    return rest


def _world(rank: int, world_size: int) -> dict:
    return {"shards": _shard_checks(rank, world_size),
            "rest": _resume_checks(rank, world_size)}


def test_sampler_on_two_ranks():
    """Shards: union = dataset (train padded by wrapping, eval exactly once and disjoint),
    permutation identical across ranks and new every epoch; equal train steps; resume mid-epoch
    from rank 0's state yields exactly the remaining sequence on every rank."""
    results = run_world(_world, world_size=2, timeout_s=90)
    assert results[0]["shards"]["orders"] == results[1]["shards"]["orders"]
    assert results[0]["shards"]["steps"] == results[1]["shards"]["steps"] == 2
    assert len(results[0]["rest"]) == len(results[1]["rest"]) == 12 - 6
    assert not set(results[0]["rest"]) & set(results[1]["rest"])
