"""Checkpoints written in the background (dptrain.train.writer): the copy taken at the step, one
write in flight, errors surfacing, and a real Trainer that keeps stepping while its checkpoint is
still being written."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from dptrain.data import load_digits
from dptrain.runtime import init_distributed
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.tagi import manual_seed
from dptrain.train import TrainConfig, Trainer
from dptrain.train import checkpoint as ckpt
from dptrain.train.writer import BackgroundWriter, snapshot
from tests._nets import tagi_mlp


def test_snapshot_copies_every_tensor_and_keeps_the_containers():
    weight = torch.arange(4.0)
    state = OrderedDict(w=weight, nested={"steps": [torch.tensor(3), 5], "pair": (weight, "a")})
    state._metadata = {"": {"version": 2}}  # what torch's state_dict carries
    copied = snapshot(state)
    weight.add_(100)  # the next training step, in place
    assert copied["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert copied["nested"]["pair"][0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert type(copied) is OrderedDict and copied._metadata == {"": {"version": 2}}
    assert type(copied["nested"]["pair"]) is tuple and copied["nested"]["pair"][1] == "a"
    assert copied["nested"]["steps"][0].item() == 3 and copied["nested"]["steps"][1] == 5
    history = [{"epoch": 1}]
    kept = snapshot({"history": history})
    history.append({"epoch": 2})
    assert kept["history"] == [{"epoch": 1}]


def test_one_write_in_flight_in_order_and_errors_are_raised_later():
    writer = BackgroundWriter()
    release, order = threading.Event(), []

    def slow():
        assert release.wait(30)
        order.append("first")

    writer.submit(slow)
    assert writer.busy  # submit returned while the write still runs
    order.append("training")
    release.set()
    writer.submit(lambda: order.append("second"))  # waits for the first one
    writer.wait()
    assert order == ["training", "first", "second"] and not writer.busy

    writer.submit(lambda: (_ for _ in ()).throw(OSError("No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # raised once
    writer.close()
    assert "dptrain-checkpoint" not in [t.name for t in threading.enumerate()]
    inline = BackgroundWriter(enabled=False)
    inline.submit(lambda: order.append("inline"))
    assert order[-1] == "inline" and not inline.busy


class _Gate:
    """Part of the learner's checkpoint state whose pickling (in the writer's thread) waits
    until the training thread has run step `open_at`; it is saved as {"gate": 7}."""

    def __init__(self, events: list[str], open_at: int):
        self.events, self.open_at, self.opened = events, open_at, threading.Event()

    def __deepcopy__(self, memo):  # the snapshot keeps it as it is
        return self

    def __reduce__(self):
        self.events.append("write started")
        self.events.append("gate opened" if self.opened.wait(20) else "gate timed out")
        return (OrderedDict, ([("gate", 7)],))


class _GatedLearner(TagiLearner):
    """A TagiLearner whose first checkpoint carries a `_Gate`; it counts its steps."""

    def __init__(self, *args, gate: _Gate, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.steps = gate, 0

    def train_step(self, batch):
        self.steps += 1
        self.gate.events.append(f"step {self.steps}")
        if self.steps == self.gate.open_at:
            self.gate.opened.set()
        return super().train_step(batch)

    def save_checkpoint(self, directory: Path, **options):
        state = super().save_checkpoint(directory, **options)
        if self.steps == 2:
            state["gate"] = self.gate
        return state

    def load_checkpoint(self, state, directory: Path):
        state.pop("gate", None)
        super().load_checkpoint(state, directory)


@pytest.mark.timeout(120)
def test_the_trainer_steps_on_while_its_checkpoint_is_written(tmp_path):
    """The checkpoint of step 2 cannot finish writing before step 3 has run: with a write that
    paused training the gate would time out. The run still ends with that checkpoint published
    and loadable, and waits for its last write."""
    digits = load_digits()
    manual_seed(0)
    events: list[str] = []
    learner = _GatedLearner(tagi_mlp(64, 11, hidden=16), task="classification", num_classes=10,
                            gate=_Gate(events, open_at=3))
    config = TrainConfig(out_dir=tmp_path, epochs=1, batch_size=256,
                         checkpoint_every=2, keep_last=10, progress=False)
    summary = Trainer(learner, digits, config, init_distributed()).fit()
    assert events.index("step 3") < events.index("gate opened"), events
    assert "gate timed out" not in events
    written = ckpt.validate(tmp_path / "checkpoints" / "step-00000002")
    assert written.load_state()["learner"]["gate"] == {"gate": 7}
    assert summary["steps"] == 6 and ckpt.latest_valid(tmp_path / "checkpoints").step == 6
    assert summary["checkpoint_pause_s"]["count"] == 3  # steps 2 and 4, and the epoch's end
    assert "dptrain-checkpoint" not in [t.name for t in threading.enumerate()]
