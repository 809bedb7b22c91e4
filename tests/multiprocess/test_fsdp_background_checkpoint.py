"""FSDP checkpoints written in the background, on 2 real ranks (docs/design.md, contracts 3 and
6): the ranks step on while their shards are being written, and a rank killed in the middle of
that write leaves the previous checkpoint, from which the run ends bit-identical to one that was
never killed.

A `_Gate` in the learner's state of the checkpoint of step 4 holds its write: torch's
distributed checkpoint pickles it in the rank's writer thread, and it waits there until that
rank's training thread has started a later step; then it lets the write go on, or SIGKILLs the
process mid-write.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.data import ArrayDataset, Split
from dptrain.learners import TorchLearner
from dptrain.runtime import init_distributed
from dptrain.train import TrainConfig, Trainer
from dptrain.train import checkpoint as ckpt
from tests._world import WorldFailed, run_world

pytestmark = pytest.mark.dist

GATED = 4  # the step whose checkpoint's write is held
STEPS = 8  # one epoch of 256 samples in global batches of 32; checkpoints every 2 steps


class _Gate:
    """Held by the shard writer's thread while it pickles the learner's extra state, until
    this rank's training thread starts step `until`: then the write goes on, or with `kill`
    the process is SIGKILLed there, its checkpoint half written."""

    def __init__(self, until: int, kill: bool) -> None:
        self.until, self.kill = until, kill
        self.events: list[str] = []
        self.started = threading.Event()

    def step_starts(self, step: int) -> None:
        self.events.append(f"step {step}")
        if step == self.until:
            self.started.set()

    def __deepcopy__(self, memo):  # the staged copy keeps the gate itself
        return self

    def __reduce__(self):
        self.events.append("write held")
        if not self.started.wait(30):
            self.events.append("gate timed out")
        elif self.kill:
            print(f"gate: SIGKILL mid-write, step {self.until} started", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.events.append("write released")
        return (dict, ([("gate", 7)],))


class _GatedLearner(TorchLearner):
    """An FSDP learner whose checkpoint of step GATED carries a `_Gate`."""

    def __init__(self, *args, gate: _Gate | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    def train_step(self, batch):
        if self.gate is not None:
            self.gate.step_starts(self.num_optimizer_steps + 1)
        return super().train_step(batch)

    def setup(self, runtime):
        super().setup(runtime)
        sharded_state = self._state.sharded_state  # what a background save hands the writer

        def gated(steps: int) -> dict:
            state = sharded_state(steps)
            if self.gate is not None and steps == GATED:
                state["extra"]["gate"] = self.gate
            return state

        self._state.sharded_state = gated


def _split() -> Split:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(320, 8, generator=generator)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return Split(name="blobs", task="classification", num_classes=4,
                 train=ArrayDataset(x[:256], y[:256]), test=ArrayDataset(x[256:], y[256:]))


def _fit(rank: int, world_size: int, out: str, gate: tuple[int, bool] | None) -> dict:
    """Train one epoch with a checkpoint every 2 steps, written in the background."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    held = None if gate is None else _Gate(*gate)
    learner = _GatedLearner(model, nn.CrossEntropyLoss(),
                            functools.partial(torch.optim.Adam, lr=1e-2), strategy="fsdp",
                            gate=held)
    config = TrainConfig(out_dir=Path(out), epochs=1, batch_size=32,
                         checkpoint_every=2, keep_last=10, progress=False)
    summary = Trainer(learner, _split(), config, init_distributed()).fit()
    return {"summary": summary, "events": [] if held is None else held.events}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run whose checkpoint of step 4 cannot be written until step 5 has started."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, run_world(_fit, str(out), (GATED + 1, False), world_size=2, timeout_s=120)


def test_fsdp_ranks_step_on_while_their_shards_are_written(uninterrupted):
    """A write that paused training would time the gate out: step 5 must start while the
    checkpoint of step 4 is still being written. That checkpoint is still published whole."""
    out, results = uninterrupted
    held = [r["events"] for r in results if "write held" in r["events"]]
    assert held, [r["events"] for r in results]  # the rank(s) that write the extra state
    for events in held:
        assert "gate timed out" not in events, events
        assert events.index(f"step {GATED + 1}") < events.index("write released"), events
    checkpoints = out / "checkpoints"
    assert [p.name for p in ckpt.list_steps(checkpoints)] == \
        [f"step-{s:08d}" for s in (8, 6, 4, 2)]
    written = ckpt.validate(checkpoints / f"step-{GATED:08d}")  # every file checksummed
    shards = {int(m.group(1)) for name in written.meta["files"]
              if (m := re.fullmatch(r"sharded/__(\d+)_\d+\.distcp", name))}
    assert shards == {0, 1} and "sharded/.metadata" in written.meta["files"], written.meta
    for r in results:
        summary = r["summary"]
        assert summary["steps"] == STEPS and summary["checkpoint_pause_s"]["count"] == 4
        assert summary["params_sha256"] == results[0]["summary"]["params_sha256"]


def test_a_rank_killed_mid_background_write_resumes_from_the_previous_checkpoint_exactly(
        uninterrupted, tmp_path):
    """Contract 3 and 6: SIGKILL the rank writing the checkpoint of step 4 once the ranks have
    stepped on to step 6; no step-4 folder is published, and a new job resumes from step 2 and
    ends with the uninterrupted run's parameters, bit for bit."""
    out = tmp_path / "run"
    # The world fails on the killed rank, or on its peer, which loses it: either way every
    # rank's output is in the message.
    with pytest.raises(WorldFailed, match=f"gate: SIGKILL mid-write, step {GATED + 2} started"):
        run_world(_fit, str(out), (GATED + 2, True), world_size=2, timeout_s=120)
    checkpoints = out / "checkpoints"
    assert [p.name for p in ckpt.list_steps(checkpoints)] == ["step-00000002"]
    assert (checkpoints / f"step-{GATED:08d}.tmp").is_dir()  # the write the kill cut short
    assert not (checkpoints / f"step-{GATED:08d}.tmp" / "meta.json").exists()

    resumed = run_world(_fit, str(out), None, world_size=2, timeout_s=120)
    _, reference = uninterrupted
    for r in resumed:
        summary = r["summary"]
        assert summary["resumed_from"] == str(checkpoints / "step-00000002")
        assert summary["steps"] == STEPS
        assert summary["params_sha256"] == reference[0]["summary"]["params_sha256"]
