"""The background writer of sharded checkpoints (dptrain.learners.shard_writer) in a world of
one: the copy is taken when `start` returns, and a write that fails is one line, raised once
(docs/design.md, contracts 3 and 6). Two ranks: tests/multiprocess/test_fsdp_background_checkpoint.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dptrain.errors import CheckpointError
from dptrain.learners.shard_writer import ShardWriter


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, timeout=timedelta(seconds=30))


def test_the_copy_is_taken_at_start_and_written_while_the_tensors_change(world_of_one, tmp_path):
    weight = torch.arange(6.0)
    state = {"model": {"w": weight}, "extra": {"steps": 3, "schedule": [0.1, 0.2]}}
    writer = ShardWriter(timedelta(seconds=30))
    writer.start(state, tmp_path / "ckpt")
    weight.add_(100)  # the next training step, in place, while the thread may still write
    state["extra"]["steps"] = 4
    writer.wait()
    back = {"model": {"w": torch.zeros(6)}, "extra": {"steps": 0, "schedule": [0.0, 0.0]}}
    dcp.load(back, checkpoint_id=tmp_path / "ckpt")
    assert back["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert back["extra"] == {"steps": 3, "schedule": [0.1, 0.2]}


def test_a_write_that_fails_is_one_line_raised_once(world_of_one, tmp_path):
    (tmp_path / "taken").write_text("a file where the folder should go")
    writer = ShardWriter(timedelta(seconds=30))
    writer.start({"w": torch.ones(3)}, tmp_path / "taken" / "ckpt")
    with pytest.raises(CheckpointError) as failed:
        writer.wait()
    message = str(failed.value)
    assert message.startswith(f"{tmp_path / 'taken' / 'ckpt'}: rank(s) [0] could not write "
                              f"their shards (") and "\n" not in message, message
    writer.wait()  # raised once
    writer.start({"w": torch.ones(3)}, tmp_path / "next")  # and the writer goes on
    writer.wait()
    assert (tmp_path / "next" / ".metadata").is_file()
