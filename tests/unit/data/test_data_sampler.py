"""ShardedSampler index math without processes: rank and world size are passed explicitly.

Pins docs/design.md, 5 (eval visits every sample exactly once), the equal-steps rule of train
mode (no rank waits at a collective), and contract 3's data half (a resumed epoch yields exactly
the remaining indices in the same order).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from dptrain.data import ArrayDataset, ShardedSampler, num_samples_per_rank, steps_per_epoch
from dptrain.data.loader import BatchLoader
from dptrain.errors import CheckpointError, ConfigError

LENGTHS = [1, 2, 3, 5, 7, 8, 13, 64, 101]
WORLD_SIZES = [1, 2, 3, 4, 8]
# every contract holds for both ways of making an epoch's order
permutations = pytest.mark.parametrize("permutation", ["stored", "computed"])


def _shards(n: int, world: int, epoch: int = 0, **kw) -> list[list[int]]:
    shards = []
    for rank in range(world):
        s = ShardedSampler(n, rank=rank, world_size=world, **kw)
        s.set_epoch(epoch)
        shards.append(list(s))
        assert len(shards[-1]) == len(s) == num_samples_per_rank(
            n, world, rank, mode=kw.get("mode", "train"), drop_last=kw.get("drop_last", False),
            uneven_last_batch=kw.get("uneven_last_batch", False))
    return shards


def _interleave(shards: list[list[int]]) -> list[int]:
    """The global order the shards were cut from (rank r holds positions r, r+W, ...)."""
    out = []
    for i in range(max(map(len, shards))):
        out.extend(s[i] for s in shards if i < len(s))
    return out


@permutations
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("n", LENGTHS)
def test_eval_mode_visits_every_index_exactly_once(n, world, permutation):
    """Contract 5: no padding, disjoint ranks, counts differ by at most one."""
    for epoch, shuffle in [(0, False), (0, True), (3, True)]:
        shards = _shards(n, world, epoch, mode="eval", shuffle=shuffle, seed=7,
                         permutation=permutation)
        assert sorted(i for s in shards for i in s) == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        if not shuffle:
            assert _interleave(shards) == list(range(n))


@permutations
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("n", LENGTHS)
def test_train_mode_pads_by_wrapping_to_equal_counts(n, world, permutation):
    """Every rank gets ceil(N/W); the padding repeats the start of the same permutation."""
    for epoch in range(3):
        shards = _shards(n, world, epoch, seed=1, permutation=permutation)
        per_rank = math.ceil(n / world)
        assert all(len(s) == per_rank for s in shards)
        order = _interleave(shards)
        assert sorted(order[:n]) == list(range(n))  # a permutation, then the wrap-around
        assert order[n:] == (order[:n] * world)[:per_rank * world - n]


@permutations
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [8, 13, 64, 101])
def test_train_mode_drop_last_drops_only_the_tail(n, world, permutation):
    for epoch in range(2):
        shards = _shards(n, world, epoch, drop_last=True, seed=1, permutation=permutation)
        flat = [i for s in shards for i in s]
        assert all(len(s) == n // world for s in shards)
        assert len(set(flat)) == len(flat) == world * (n // world)
        assert set(flat) <= set(range(n))


@permutations
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("n", LENGTHS)
def test_uneven_last_batch_neither_pads_nor_drops(n, world, permutation):
    """Every index exactly once, in the permutation's order; the last ranks hold one fewer."""
    for epoch in range(2):
        shards = _shards(n, world, epoch, seed=1, uneven_last_batch=True,
                         permutation=permutation)
        assert _interleave(shards) == _interleave(_shards(n, 1, epoch, seed=1,
                                                          permutation=permutation)[:1])
        assert [len(s) for s in shards] == [len(range(r, n, world)) for r in range(world)]


def _steps(n: int, world: int, global_batch: int, *, state: dict | None = None,
           epoch: int = 1, stop_after: int | None = None, **kw) -> tuple[list[list[int]], dict]:
    """The samples of each global step (sorted: their order within a step changes no update),
    through the Trainer's data path (a BatchLoader per rank over a dataset whose targets are
    the sample indices); starting from `state` if given, stopping after `stop_after` steps.
    Also returns rank 0's sampler state at the stop."""
    data = ArrayDataset(torch.zeros(n, 1), torch.arange(n))
    per_rank, states = [], []
    for rank in range(world):
        sampler = ShardedSampler(n, rank=rank, world_size=world, seed=4, **kw)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
        batches: list[list[int]] = []
        for _, y in BatchLoader(data, sampler, global_batch // world) if stop_after != 0 else ():
            batches.append(y.tolist())
            if len(batches) == stop_after:
                break
        per_rank.append(batches)
        states.append(sampler.state_dict())  # what a checkpoint after the last step saves
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks take different numbers of steps: {counts}"
    assert all(s["position"] == states[0]["position"] for s in states), "positions differ"
    return [sorted(i for b in step for i in b) for step in zip(*per_rank)], states[0]


# (samples, global batch): the last step full, of 5 samples, of 1 (an empty batch on every
# rank but rank 0), and an epoch of fewer samples than 8 ranks hold in one step
CASES = [(64, 8), (101, 8), (13, 8), (41, 8), (9, 8)]


@permutations
@pytest.mark.parametrize("n, global_batch", CASES)
def test_a_global_step_is_the_same_samples_on_any_world_size(n, global_batch, permutation):
    """Which sample indices make up each global step, on 1 rank and on 2, 4 and 8: the same
    with `uneven_last_batch` (TAGI's sum mode), every step; padded (torch learners), every step
    but an epoch's last, which on N ranks adds up to N - 1 samples from the permutation's
    start."""
    alone, _ = _steps(n, 1, global_batch, permutation=permutation)
    assert sorted(i for step in alone for i in step) == list(range(n))
    assert len(alone) == steps_per_epoch(n, 1, global_batch)
    for world in (2, 4, 8):
        uneven, _ = _steps(n, world, global_batch, uneven_last_batch=True,
                           permutation=permutation)
        assert uneven == alone, world
        padded, _ = _steps(n, world, global_batch, permutation=permutation)
        assert padded[:-1] == alone[:-1], world
        extra = list(padded[-1])
        for i in alone[-1]:
            extra.remove(i)
        assert len(extra) == world * math.ceil(n / world) - n <= world - 1
        first = _interleave(_shards(n, 1, 1, seed=4, permutation=permutation))[:len(extra)]
        assert sorted(extra) == sorted(first), world


@permutations
@pytest.mark.parametrize("uneven", [True, False])
@pytest.mark.parametrize("saved_world, world", [(2, 1), (1, 2), (2, 4), (8, 2), (4, 8)])
@pytest.mark.parametrize("n, global_batch", CASES)
def test_a_position_saved_on_one_world_size_continues_on_another(n, global_batch, saved_world,
                                                                  world, uneven, permutation):
    """Stopped after k steps on `saved_world` ranks, rank 0's sampler state continues on
    `world` ranks with step k + 1 of the uninterrupted run: the global position is steps done x
    global batch, whatever the world size (padded: all but the epoch's last step)."""
    kw = {"uneven_last_batch": uneven, "permutation": permutation}
    full, _ = _steps(n, world, global_batch, **kw)
    for k in range(len(full)):
        done, state = _steps(n, saved_world, global_batch, stop_after=k, **kw)
        assert state["position"] == k * global_batch // saved_world
        rest, end = _steps(n, world, global_batch, state=state, **kw)
        assert len(rest) == len(full) - k
        assert (done + rest)[:-1] == full[:-1] and (not uneven or rest[-1:] == full[-1:])
        assert end["position"] == ShardedSampler(n, rank=0, world_size=world).num_slots


@permutations
def test_permutation_depends_on_seed_and_epoch_only(permutation):
    """Same on every rank for an epoch, new each epoch, and immune to the global RNG."""
    n, world = 101, 4
    orders = []
    for epoch in range(3):
        torch.manual_seed(1000 + epoch)  # user code drawing random numbers must not matter
        orders.append(_interleave(_shards(n, world, epoch, seed=5, permutation=permutation)))
    assert orders[0] == _interleave(_shards(n, world, 0, seed=5, permutation=permutation))
    assert orders[0] != orders[1] != orders[2]
    assert orders[0] != _interleave(_shards(n, world, 0, seed=6, permutation=permutation))
    rng = torch.get_rng_state()
    list(ShardedSampler(n, rank=0, world_size=1, permutation=permutation))
    assert torch.equal(rng, torch.get_rng_state())


def test_shuffle_defaults_train_on_eval_off():
    assert ShardedSampler(10, rank=0, world_size=1).shuffle
    assert list(ShardedSampler(10, rank=0, world_size=1, mode="eval")) == list(range(10))


@permutations
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("n, world, rank", [(13, 2, 1), (13, 3, 2), (64, 4, 0), (7, 8, 5)])
def test_resume_mid_epoch_yields_exactly_the_rest(n, world, rank, mode, permutation):
    """Contract 3 (data half): a sampler restored from state at any position continues the
    same sequence, via __iter__ and via batches(); the permutation comes from the state."""
    full = ShardedSampler(n, rank=rank, world_size=world, seed=3, mode=mode, shuffle=True,
                          permutation=permutation)
    full.set_epoch(2)
    expected = list(full)
    for k in range(len(expected) + 1):
        run = ShardedSampler(n, rank=rank, world_size=world, seed=3, mode=mode, shuffle=True,
                             permutation=permutation)
        run.set_epoch(2)
        it = iter(run)
        seen = [next(it) for _ in range(k)]
        state = run.state_dict()
        assert state["position"] == k and seen == expected[:k]
        resumed = ShardedSampler(n, rank=rank, world_size=world, seed=99, mode=mode,
                                 shuffle=True)
        resumed.load_state_dict(state)  # the seed comes from the state
        resumed.set_epoch(2)  # what a resumed Trainer does; same epoch keeps the position
        assert list(resumed) == expected[k:]
        batched = ShardedSampler(n, rank=rank, world_size=world, mode=mode, shuffle=True)
        batched.load_state_dict(state)
        assert torch.cat([torch.empty(0, dtype=torch.long), *batched.batches(3)]).tolist() \
            == expected[k:]


def test_position_rules():
    s = ShardedSampler(10, rank=0, world_size=2, seed=0)
    s.set_epoch(1)
    first = list(s)
    assert s.position == len(s) == 5 and s.num_remaining == 0
    assert list(s) == first  # after running to the end, the epoch starts again from 0
    s.set_position(5)
    assert list(s) == []  # a position set (or loaded) at the end is honoured: nothing left
    assert list(s) == first
    s.set_position(3)
    s.set_epoch(1)
    assert s.position == 3  # same epoch: kept
    s.set_epoch(2)
    assert s.position == 0  # new epoch: reset
    with pytest.raises(ConfigError, match=r"position must be an int in \[0, 5\].*got 6"):
        s.set_position(6)


def test_batches_keep_the_partial_batch_and_match_steps_per_epoch():
    for n, world, b in [(13, 2, 3), (100, 4, 5), (7, 3, 4), (9, 2, 2)]:
        for drop_last in (False, True):
            for drop_partial in (False, True):
                counts = set()
                for rank in range(world):
                    s = ShardedSampler(n, rank=rank, world_size=world, drop_last=drop_last)
                    batches = list(s.batches(b, drop_partial=drop_partial))
                    counts.add(len(batches))
                    assert len(batches) == s.num_batches(b, drop_partial=drop_partial)
                    assert all(len(x) == b for x in batches[:-1])
                    assert sum(map(len, batches)) in (len(s), len(s) // b * b)
                    assert s.position == len(s)  # a dropped partial batch counts as consumed
                assert counts == {steps_per_epoch(n, world, b, drop_last=drop_last,
                                                  drop_partial=drop_partial)}


def test_state_dict_refuses_a_different_run():
    s = ShardedSampler(20, rank=0, world_size=2)
    state = s.state_dict()
    for kw in ({"mode": "eval"}, {"drop_last": True}):  # other samples exist per world size
        with pytest.raises(CheckpointError, match="world_size: saved 2, now 4"):
            ShardedSampler(20, rank=0, world_size=4, **kw).load_state_dict(
                ShardedSampler(20, rank=0, world_size=2, **kw).state_dict())
    s.set_position(3)  # 6 samples of the epoch: 2 ranks continue, 4 cannot split them
    with pytest.raises(CheckpointError, match=r"3 sample\(s\) per rank on 2 rank\(s\) = 6 "
                                              r"samples of the epoch, which do not split over "
                                              r"4 rank\(s\)"):
        ShardedSampler(20, rank=0, world_size=4).load_state_dict(s.state_dict())
    with pytest.raises(CheckpointError, match="num_samples: saved 20, now 21"):
        ShardedSampler(21, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(CheckpointError, match="missing"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(CheckpointError, match="position=11"):
        s.load_state_dict({**state, "position": 11})


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, world_size=2\), got 2"),
    ({"rank": 1}, r"rank must be an int in \[0, world_size=1\), got 1"),  # no group: world 1
    ({"world_size": 0, "rank": 0}, "world_size must be a positive int, got 0"),
    ({"mode": "test"}, "mode must be one of .*got 'test'"),
    ({"mode": "eval", "drop_last": True}, "drop_last=True is only allowed in train mode"),
    ({"mode": "eval", "uneven_last_batch": True},
     "uneven_last_batch=True is only allowed in train mode"),
    ({"drop_last": True, "uneven_last_batch": True}, "choose one"),
    ({"rank": 0, "world_size": 8, "drop_last": True}, "leaves every rank empty"),
])
def test_bad_arguments_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ShardedSampler(5, **kwargs)


@pytest.mark.parametrize("bad, match", [(0, "at least one sample"), (True, "got True"),
                                        (object(), "got object")])
def test_bad_length_raises_config_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        ShardedSampler(bad)


def test_defaults_without_process_group_are_rank_0_of_1():
    s = ShardedSampler(ArrayDataset(torch.zeros(6, 2), torch.zeros(6)))
    assert (s.rank, s.world_size, len(s)) == (0, 1, 6)


# Python >= 3.12 warns when forking a process that has threads (torch's pool); the DataLoader
# workers only index tensors, which is safe after fork.
@pytest.mark.filterwarnings("ignore:.*multi-threaded.*fork:DeprecationWarning")
def test_works_as_torch_sampler_with_dataloader_workers():
    """A DataLoader with 2 worker processes sees this rank's indices in order; a sampler set
    to a position (as the Trainer does on resume) makes the loader yield only the rest."""
    ds = ArrayDataset(torch.arange(50.0).reshape(25, 2), torch.arange(25))
    s = ShardedSampler(ds, rank=1, world_size=2, seed=3)
    s.set_epoch(1)
    # pinned memory only where there is an accelerator: on CPU-only torch it just warns
    loader = DataLoader(ds, batch_size=4, sampler=s, num_workers=2, timeout=30,
                        pin_memory=torch.cuda.is_available())
    ys = [y for _, y in loader]
    assert torch.cat(ys).tolist() == s.indices().tolist()
    assert [len(y) for y in ys] == [4, 4, 4, 1]
    s.set_position(8)
    xs = torch.cat([x for x, _ in DataLoader(ds, batch_size=4, sampler=s)])
    assert torch.equal(xs, ds.x[s.indices()[8:]])
