"""Checkpoint files: atomic publish, checksum, skipping broken ones (docs/design.md, contract 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.errors import CheckpointError
from dptrain.train import checkpoint as ckpt
from dptrain.train.early_stopping import EarlyStopping


def _save(directory: Path, step: int, value: float = 1.0) -> Path:
    tmp = ckpt.begin(directory, step)
    return ckpt.commit(tmp, {"w": torch.full((4,), value), "step": step}, {"step": step})


def test_commit_publishes_and_validates(tmp_path):
    path = _save(tmp_path, 7, 3.0)
    assert path.name == "step-00000007" and not list(tmp_path.glob("*.tmp"))
    found = ckpt.latest_valid(tmp_path)
    assert found.step == 7 and found.load_state()["w"].tolist() == [3.0] * 4


def test_corrupt_and_incomplete_checkpoints_are_skipped_with_a_reason(tmp_path, caplog):
    _save(tmp_path, 1)
    good = _save(tmp_path, 2)
    bad = _save(tmp_path, 3)
    data = bytearray((bad / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "state.pt").write_bytes(data)
    incomplete = _save(tmp_path, 4)
    (incomplete / "meta.json").unlink()
    with caplog.at_level("WARNING"):
        found = ckpt.latest_valid(tmp_path)
    assert found.path == good
    text = caplog.text
    assert "step-00000004: incomplete checkpoint (no meta.json)" in text
    assert "step-00000003/state.pt: checksum mismatch" in text
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.validate(bad)


def test_prune_keeps_the_newest_and_best_is_a_copy(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, float(step))
    ckpt.copy_as_best(tmp_path / "step-00000002", tmp_path)
    ckpt.prune(tmp_path, keep_last=2)
    assert [p.name for p in ckpt.list_steps(tmp_path)] == ["step-00000004", "step-00000003"]
    assert ckpt.validate(tmp_path / "best").load_state()["w"][0].item() == 2.0


KILLED_WRITER = """
import sys, torch
from pathlib import Path
from dptrain.train import checkpoint as ckpt
d = Path(sys.argv[1])
ckpt.commit(ckpt.begin(d, 1), {"w": torch.ones(3)}, {"step": 1})
tmp = ckpt.begin(d, 2)
print("writing", flush=True)
big = {"w%d" % i: torch.randn(2_000_000) for i in range(40)}   # ~320 MB: takes a while
ckpt.commit(tmp, big, {"step": 2})
"""


def test_a_kill_during_the_write_leaves_the_previous_checkpoint_valid(tmp_path):
    """A process SIGKILLed while writing step 2 leaves step 1 as the newest valid checkpoint."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        partial = tmp_path / "step-00000002.tmp" / "state.pt"
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size > 0):
            assert proc.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    assert not (tmp_path / "step-00000002").exists()
    found = ckpt.latest_valid(tmp_path)
    assert found.step == 1 and found.load_state()["w"].tolist() == [1.0, 1.0, 1.0]


def test_early_stopping_counts_patience_and_restores():
    es = EarlyStopping("test_error", mode="min", patience=2)
    history = [0.5, 0.4, 0.45, 0.41]
    stops = []
    for epoch, value in enumerate(history, 1):
        es.update(epoch, {"test_error": value})
        stops.append(es.should_stop)
    assert stops == [False, False, False, True] and es.best_epoch == 2
    again = EarlyStopping("test_error", patience=2)
    again.load_state_dict(es.state_dict())
    assert (again.best, again.best_epoch, again.should_stop) == (0.4, 2, True)
    maximise = EarlyStopping("test_log_likelihood", mode="max")
    assert maximise.update(1, {"test_log_likelihood": -2.0})
    assert not maximise.update(2, {"test_log_likelihood": -3.0})
    with pytest.raises(ValueError, match="monitors 'loss', but the evaluation gave only"):
        EarlyStopping("loss").update(1, {"test_error": 0.1})


def _save_with_shard(directory: Path, step: int) -> Path:
    """A checkpoint laid out as a sharded learner leaves it: shards written before the commit."""
    tmp = ckpt.begin(directory, step)
    (tmp / "sharded").mkdir()
    (tmp / "sharded" / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (tmp / "sharded" / ".metadata").write_bytes(b"metadata of step %d" % step)
    return ckpt.commit(tmp, {"step": step}, {"step": step})


@pytest.mark.parametrize("name", ["sharded/__0_0.distcp", "sharded/.metadata"])
def test_a_corrupt_or_missing_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog, name):
    good = _save_with_shard(tmp_path, 1)
    bad = _save_with_shard(tmp_path, 2)
    assert set(ckpt.validate(bad).meta["files"]) == {"state.pt", "sharded/__0_0.distcp",
                                                     "sharded/.metadata"}
    shard = bad / name
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(data)
    with caplog.at_level("WARNING"):
        assert ckpt.latest_valid(tmp_path).path == good
    assert f"step-00000002/{name}: checksum mismatch" in caplog.text
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{name}: missing"):
        ckpt.validate(bad)


def test_format_1_checkpoints_are_still_read_and_unknown_versions_refused(tmp_path):
    import json

    path = _save(tmp_path, 5, 2.0)
    meta = json.loads((path / "meta.json").read_text())
    old = {**{k: v for k, v in meta.items() if k != "files"}, "format_version": 1,
           "sha256": meta["files"]["state.pt"]}
    (path / "meta.json").write_text(json.dumps(old))
    assert ckpt.validate(path).load_state()["w"][0].item() == 2.0
    (path / "meta.json").write_text(json.dumps({**old, "format_version": 9}))
    with pytest.raises(CheckpointError, match="format version 9, this dptrain reads 1, 2"):
        ckpt.validate(path)
