"""A checkpoint's state (`dptrain.train.state.TrainState`): what the Trainer writes is what it
reads, and checkpoints written before the state had a class of its own read back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain.data import load_digits
from dptrain.data.datasets.holdout import hold_out
from dptrain.learners.recipes import make_learner
from dptrain.runtime import init_distributed
from dptrain.train import TrainConfig, Trainer
from dptrain.train import checkpoint as ckpt
from dptrain.train.state import TrainState

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "data").glob(
    "run_before_*/checkpoints/*/state.pt"))


def _state(**steps) -> TrainState:
    return TrainState(learner={"model": {"w": torch.ones(2)}}, epoch=1, step=7, epoch_done=False,
                      sampler={"epoch": 1, "position": 96}, rng=[{"torch": torch.zeros(3)}],
                      early_stopping={"monitor": "val_error", "best": 0.1, "best_epoch": 1,
                                      "bad_epochs": 0},
                      history=[{"epoch": 1, "step": 5, "train_loss": 0.5}],
                      partial_sums=[{"loss": (1.0, 2.0)}], **steps)


def test_a_run_in_epochs_writes_no_step_keys_and_reads_back_whole():
    state = _state()
    written = state.to_dict()
    assert set(written["trainer"]) == {"epoch", "step", "epoch_done", "partial_sums"}
    assert TrainState.from_dict(written) == state
    assert not state.counts_steps


def test_a_run_in_steps_writes_its_points_and_reads_back_whole():
    state = _state(step_history=[{"step": 5, "val_error": 0.1}], best_step=5,
                   point_sums=[{"loss": (0.5, 1.0)}])
    written = state.to_dict()
    assert written["trainer"]["best_step"] == 5 and state.counts_steps
    assert TrainState.from_dict(written) == state
    assert TrainState.from_dict(written).to_dict() == written


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.parts[-4])
def test_checkpoints_written_before_read_back_as_they_are(path):
    saved = torch.load(path, weights_only=False)
    assert TrainState.from_dict(saved).to_dict() == saved


def test_the_trainers_checkpoints_are_train_states(tmp_path):
    torch.manual_seed(0)
    split = hold_out(load_digits(), 0.1, seed=0)
    config = TrainConfig(out_dir=tmp_path, batch_size=64, max_steps=6, val_every=3,
                         progress=False, async_checkpoints=False)
    Trainer(make_learner("torch-mlp"), split, config, init_distributed()).fit()
    last = ckpt.validate(tmp_path / "checkpoints" / "step-00000006")
    state = last.load_state()
    restored = TrainState.from_dict(state)
    assert restored.step == 6 and restored.counts_steps and restored.best_step in (3, 6)
    assert [row["step"] for row in restored.step_history] == [3, 6]
    assert restored.to_dict().keys() == state.keys()
    assert restored.to_dict()["trainer"].keys() == state["trainer"].keys()
    assert last.meta["step"] == 6 and last.meta["world_size"] == 1
