"""text: windows on 2 real ranks (one spawned gloo world, a few seconds): each rank loads the
text itself, and the ranks' batches of every step are, together, the batch a single process
takes at that step with the same global batch: the same windows, the epoch's offset included
(docs/design.md contract 3, for token data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._world import run_world

pytestmark = pytest.mark.dist

TEXT = "".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(40))


def _first_tokens(path: str, rank: int | None, world_size: int | None, local_batch: int,
                  epochs: int) -> list[list[list[int]]]:
    """Per epoch and step, the first two ids of each window of this rank's batch."""
    from dptrain.data import ShardedSampler
    from dptrain.data.config import DataConfig, load_split
    from dptrain.data.loader import BatchLoader

    split = load_split(DataConfig(dataset=f"text:{path}", block_size=16), seed=7)
    sampler = ShardedSampler(split.train, rank=rank, world_size=world_size, seed=7)
    loader = BatchLoader(split.train, sampler, local_batch)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([x[:, :2].tolist() for x, _ in loader])
    return out


def _rank(rank: int, world_size: int, path: str) -> list:
    return _first_tokens(path, None, None, 3, epochs=3)  # rank and world from the group


def test_two_ranks_train_on_the_windows_of_one_process(tmp_path: Path):
    path = tmp_path / "input.txt"
    path.write_text(TEXT, encoding="utf-8")
    ranks = run_world(_rank, str(path), world_size=2, timeout_s=120)
    single = _first_tokens(str(path), 0, 1, 6, epochs=3)
    starts = set()
    for epoch in range(3):
        assert len(ranks[0][epoch]) == len(ranks[1][epoch]) == len(single[epoch])
        for step, batch in enumerate(single[epoch]):
            together = ranks[0][epoch][step] + ranks[1][epoch][step]
            if step < len(single[epoch]) - 1:
                assert sorted(together) == sorted(batch), (epoch, step)
            else:  # the epoch's last step: 2 ranks pad an odd count by wrapping around
                assert all(w in together for w in batch), (epoch, step)
        starts.add(tuple(map(tuple, single[epoch][0])))
    assert len(starts) == 3  # a new order (and offset) every epoch
