"""`BatchLoader`: the same batches with or without worker processes, a sampler position that
counts only what was handed out (exact resume with workers), data errors from a worker in one
line, and no worker left behind (docs/design.md, contracts 3 and 9)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.data import ShardedSampler, load_digits
from dptrain.data import loader as loader_module
from dptrain.data.config import DataConfig, load_split
from dptrain.data.loader import BatchLoader
from dptrain.errors import DataError
from tests._images import write_digits_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_digits_folder(tmp_path_factory.mktemp("digits"), per_class=8)


def _epochs(dataset, workers: int, epochs=(0, 1), rank: int = 1) -> list[tuple]:
    sampler = ShardedSampler(dataset, rank=rank, world_size=2, seed=5)
    with BatchLoader(dataset, sampler, 8, workers=workers) as loader:
        out = []
        for epoch in epochs:
            sampler.set_epoch(epoch)
            out += [(x.clone(), y.clone()) for x, y in loader]
    return out


@pytest.mark.parametrize("kind", ["folder", "arrays"])
def test_workers_never_change_a_batch(folder, kind):
    if kind == "folder":
        dataset = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16),
                             seed=1).train  # random crops and flips
    else:
        dataset = load_digits().train
    alone, helped = _epochs(dataset, 0), _epochs(dataset, 2)
    per_epoch = -(-len(dataset) // 2 // 8)  # this rank's half, in batches of 8
    assert len(alone) == len(helped) == 2 * per_epoch
    for (xa, ya), (xb, yb) in zip(alone, helped):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(alone[0][0], alone[5][0]), "each epoch is drawn anew"


def test_the_position_counts_only_batches_handed_out(folder):
    dataset = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16),
                         seed=1).train
    whole = _epochs(dataset, 2, epochs=(4,))
    sampler = ShardedSampler(dataset, rank=1, world_size=2, seed=5)
    sampler.set_epoch(4)
    with BatchLoader(dataset, sampler, 8, workers=2, prefetch=4) as loader:
        batches = iter(loader)
        first = [next(batches) for _ in range(2)]  # the workers have made more than these
        assert sampler.position == 16
        state = sampler.state_dict()
    resumed = ShardedSampler(dataset, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)
    with BatchLoader(dataset, resumed, 8, workers=2) as loader:
        rest = list(loader)
    assert len(first) + len(rest) == len(whole)
    for (xa, ya), (xb, yb) in zip([*first, *rest], whole):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_a_corrupt_image_met_by_a_worker_is_one_line_naming_it(folder, tmp_path):
    root = Path(shutil.copytree(folder, tmp_path / "copy"))
    bad = sorted((root / "train" / "digit6").glob("*.png"))[1]
    bad.write_bytes(bad.read_bytes()[:50])
    # mean and std given: no image is decoded before the workers meet the bad one
    dataset = load_split(DataConfig(dataset=f"imagefolder:{root}", image_size=16, mean="0.5",
                                    std="0.3"), seed=1).train
    sampler = ShardedSampler(dataset, rank=0, world_size=1, seed=5)
    with pytest.raises(DataError) as info, BatchLoader(dataset, sampler, 8, workers=2) as loader:
        list(loader)
    assert str(info.value).startswith(f"{bad}: not a readable image")
    assert "Traceback" not in str(info.value) and "\n" not in str(info.value)


def test_closing_stops_every_worker(folder):
    dataset = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16),
                         seed=1).train
    sampler = ShardedSampler(dataset, rank=0, world_size=1, seed=5)
    loader = BatchLoader(dataset, sampler, 8, workers=2)
    next(iter(loader))
    assert len(multiprocessing.active_children()) >= 2
    loader.close()
    assert multiprocessing.active_children() == []


_KILLED_OWNER = """
import sys, time
from dptrain.data import ShardedSampler
from dptrain.data import loader as loader_module
from dptrain.data.config import DataConfig, load_split
from dptrain.data.loader import BatchLoader
dataset = load_split(DataConfig(dataset="imagefolder:" + sys.argv[1], image_size=16), seed=1).train
loader = BatchLoader(dataset, ShardedSampler(dataset, rank=0, world_size=1, seed=5), 8, workers=2)
next(iter(loader))
print(*(w.pid for w in loader._loader._iterator._workers), flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _hang_first_start(marker: Path, always: bool = False):
    """A worker start that never reports, as a fork deadlocked before running Python (CPython
    gh-112275) does: the first worker to start (or every one) sleeps instead."""
    start = loader_module._start_worker

    def starting(ready: int, worker_id: int) -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            first = True
        except FileExistsError:
            first = False
        if first or always:
            time.sleep(600)
        start(ready, worker_id)
    return starting


def test_workers_that_never_start_are_started_again(folder, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loader_module, "WORKER_START_S", 2.0)
    monkeypatch.setattr(loader_module, "_start_worker", _hang_first_start(tmp_path / "hung"))
    dataset = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16),
                         seed=1).train
    helped, alone = _epochs(dataset, workers=2), _epochs(dataset, workers=0)
    assert len(helped) == len(alone) > 0
    for (xa, ya), (xb, yb) in zip(alone, helped):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert "did not start within 2 s" in caplog.text and "attempt 2 of 3" in caplog.text


def test_workers_that_never_start_end_in_one_line(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(loader_module, "WORKER_START_S", 1.0)
    monkeypatch.setattr(loader_module, "WORKER_STARTS", 1)
    monkeypatch.setattr(loader_module, "_start_worker",
                        _hang_first_start(tmp_path / "hung", always=True))
    dataset = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16),
                         seed=1).train
    with pytest.raises(DataError, match="did not start in 1 attempts of 1 s each; --workers 0"):
        _epochs(dataset, workers=2)
    assert multiprocessing.active_children() == []


def test_workers_end_with_a_process_killed_outright(folder):
    """SIGKILL leaves no time to close the loader: the workers, forks of the killed process,
    watch their parent (torch's worker watchdog) and end with it."""
    owner = subprocess.Popen([sys.executable, "-c", _KILLED_OWNER, str(folder)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(workers) == 2 and all(map(_running, workers)), workers
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, workers)), f"left behind: {workers}"
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        owner.stdout.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_skipping_bad_images_leaves_them_out_and_names_them(folder, tmp_path, workers):
    root = Path(shutil.copytree(folder, tmp_path / "copy"))
    bad = sorted((root / "train" / "digit6").glob("*.png"))[1]
    bad.write_bytes(bad.read_bytes()[:50])
    dataset = load_split(DataConfig(dataset=f"imagefolder:{root}", image_size=16,
                                    bad_images="skip"), seed=1).train
    sampler = ShardedSampler(dataset, rank=0, world_size=1, seed=5)
    with BatchLoader(dataset, sampler, 8, workers=workers) as loader:
        sizes = [len(y) for _, y in loader]
    assert sum(sizes) == len(dataset) - 1 and sorted(sizes)[0] == 7
    assert len(loader.skipped) == 1 and str(bad) in next(iter(loader.skipped))


def test_an_image_folder_batch_is_its_items_stacked(folder):
    """The whole-batch path (rows filled in place, shared memory in workers) gives the bits of
    `dataset[i]` stacked, as the DataLoader's default collate would."""
    dataset = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16),
                         seed=2).train
    dataset.set_epoch(3)
    indices = torch.tensor([5, 0, 17, 5])
    x, y = dataset.batch(indices, shared=True)
    items = [dataset[int(i)] for i in indices]
    assert torch.equal(x, torch.stack([item[0] for item in items]))
    assert torch.equal(y, torch.stack([item[1] for item in items]))
    assert x.dtype == torch.float32 and x.shape == (4, 1, 16, 16)
