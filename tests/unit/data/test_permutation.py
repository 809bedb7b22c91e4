"""The computed permutation: a bijection of range(n) from (seed, epoch) alone, evaluated per
position, that the sampler uses for token windows so an epoch costs no memory."""

from __future__ import annotations

import resource

import numpy as np
import pytest
import torch

from dptrain.data import ShardedSampler
from dptrain.data.permutation import ComputedPermutation
from dptrain.errors import CheckpointError


@pytest.mark.parametrize("n", [*range(1, 70), 127, 128, 129, 1000, 4097, 65537])
def test_every_length_gets_a_permutation(n):
    for seed, epoch in [(0, 0), (3, 1), (12345, 99)]:
        values = ComputedPermutation(n, seed, epoch)[torch.arange(n)]
        assert sorted(values.tolist()) == list(range(n))


def test_the_order_is_fixed_integer_arithmetic():
    """Integer operations only: every CPU and every version computes these very orders, so a
    checkpoint's position means the same windows wherever it resumes. A change here changes
    which samples a resumed run of an older version visits."""
    assert ComputedPermutation(10, 0, 0)[torch.arange(10)].tolist() == \
        [7, 4, 2, 3, 1, 0, 6, 8, 9, 5]
    assert ComputedPermutation(1000003, 7, 2)[torch.arange(8)].tolist() == \
        [122665, 347734, 62392, 41731, 124986, 532683, 494427, 157871]


def test_positions_in_any_shape_and_order_give_the_same_values():
    perm = ComputedPermutation(1000, 5, 1)
    full = perm[torch.arange(1000)]
    picked = torch.tensor([[999, 0], [17, 500]])
    assert torch.equal(perm[picked], full[picked])
    assert perm[torch.empty(0, dtype=torch.long)].numel() == 0
    with pytest.raises(IndexError, match=r"\[0, 1000\)"):
        perm[torch.tensor([1000])]


def test_it_shuffles_like_a_random_permutation():
    """No trace of the position in the value: no correlation, neighbours scattered, about one
    fixed point (a random permutation has 1 on average), different seeds and epochs unrelated."""
    n = 100_000
    positions = np.arange(n)
    values = ComputedPermutation(n, 1, 1)[torch.arange(n)].numpy()
    assert abs(np.corrcoef(positions, values)[0, 1]) < 0.02
    assert np.mean(np.abs(np.diff(values)) == 1) < 0.001
    assert np.sum(values == positions) <= 6
    other = ComputedPermutation(n, 1, 2)[torch.arange(n)].numpy()
    assert np.mean(values == other) < 0.001
    assert abs(np.corrcoef(values, other)[0, 1]) < 0.02
    # each position lands in each tenth of the range about equally often over many epochs
    tenths = np.stack([ComputedPermutation(1000, 0, e)[torch.arange(100)].numpy() // 100
                       for e in range(200)])
    counts = np.bincount(tenths.ravel(), minlength=10)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()


def test_a_billion_samples_cost_no_memory():
    """A stored permutation of 10^9 samples would be 8 GB; the computed one draws a step's
    batches, and resumes mid-epoch on another world size, without allocating it."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = 10**9
    samplers = [ShardedSampler(n, rank=r, world_size=2, seed=3, permutation="computed")
                for r in range(2)]
    for s in samplers:
        s.set_epoch(4)
    first = [next(s.batches(64)) for s in samplers]
    assert all(len(b) == 64 for b in first)
    assert len(set(torch.cat(first).tolist())) == 128 and int(torch.cat(first).max()) < n
    alone = ShardedSampler(n, rank=0, world_size=1, permutation="computed")
    alone.load_state_dict(samplers[0].state_dict())
    assert alone.position == 128
    batch = next(alone.batches(128))
    again = [next(s.batches(64)) for s in samplers]
    assert sorted(batch.tolist()) == sorted(torch.cat(again).tolist())
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 100, f"peak memory grew by {grown_mb:.0f} MB"


def test_token_windows_ask_for_the_computed_permutation():
    from dptrain.data.datasets.token_windows import TokenArray, TokenWindows

    windows = TokenWindows(TokenArray(np.arange(1000)), 0, 1000, block_size=8, name="train")
    assert ShardedSampler(windows, rank=0, world_size=1).permutation == "computed"
    assert ShardedSampler(100, rank=0, world_size=1).permutation == "stored"


def test_the_state_carries_the_permutation_and_an_old_state_means_stored():
    """A checkpoint written before the computed permutation existed resumes with the order it
    was written with (torch.randperm's), not the one a new sampler would choose."""
    stored = ShardedSampler(50, rank=0, world_size=1, seed=2)
    stored.set_epoch(1)
    expected = list(stored)
    state = {**stored.state_dict(), "position": 10}
    del state["permutation"]
    resumed = ShardedSampler(50, rank=0, world_size=1, permutation="computed")
    resumed.load_state_dict(state)
    assert resumed.permutation == "stored" and list(resumed) == expected[10:]
    with pytest.raises(CheckpointError, match="permutation must be one of"):
        resumed.load_state_dict({**state, "permutation": "sorted"})
