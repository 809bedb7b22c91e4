"""Bad optimizer and schedule options are one line before any worker starts (docs/design.md,
contract 6): from the options alone where they suffice, else from the launcher's preflight,
which knows the data set's size; a TAGI model given one is told its own knobs."""

from __future__ import annotations

import pytest

from dptrain.cli.main import main
from dptrain.errors import ConfigError
from dptrain.train.options import TrainOptions

TORCH = {"model": "torch-mlp"}


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "rmsprop"}, "optimizer: expected one of adam, adamw, sgd, lars, got 'rmsprop'"),
    ({"weight_decay": -1e-4}, "weight-decay: expected a value >= 0, got -0.0001"),
    ({"optimizer": "sgd", "momentum": -0.9}, "momentum: expected a value in [0, 1), got -0.9"),
    ({"optimizer": "sgd", "nesterov": True}, "nesterov needs a momentum > 0"),
    ({"momentum": 0.9}, "momentum is for optimizer sgd or lars; adam keeps its own"),
    ({"milestones": "30,sixty"}, "milestones: expected comma-separated numbers"),
    ({"label_smoothing": 1.0}, "label-smoothing: expected a value in [0, 1)"),
    ({"ema": 1.0}, "ema: expected a decay in [0, 1) (0: no EMA)"),
    ({"lr_scaling": "cube"}, "lr-scaling: expected none, linear, sqrt"),
    ({"mixup": -0.2}, "mixup: expected an alpha >= 0 (0: off), got -0.2"),
])
def test_bad_torch_options_are_one_line(options, message):
    with pytest.raises(ConfigError) as caught:
        TrainOptions(**TORCH, **options)
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_a_tagi_model_given_optimizer_options_names_its_sigma_v_options():
    with pytest.raises(ConfigError) as caught:
        TrainOptions(model="tagi-cnn", optimizer="sgd", momentum=0.9, warmup=2)
    assert str(caught.value) == (
        "--optimizer, --momentum, --warmup: for torch models; tagi-cnn is a TAGI model, which "
        "has no learning rate or optimizer: its update is set by --sigma-v, --sigma-v-min and "
        "--sigma-v-decay")
    TrainOptions(model="tagi-cnn", sigma_v=0.1)  # its own options stay fine


def test_a_warmup_longer_than_the_run_fails_in_the_launcher_before_any_worker(capsys, tmp_path):
    """2 processes: the launcher's preflight reads the data (1437 digits at batch 256: 6 steps
    per epoch) and refuses before starting torchrun."""
    code = main(["train", "--model", "torch-mlp", "--hidden", "8", "--nproc", "2",
                 "--batch-size", "256", "--epochs", "2", "--warmup", "12",
                 "--schedule-unit", "steps", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err == ("dptrain train: error: warmup 12 steps is as long as the run "
                                 "or longer (2 epochs of 6 steps = 12 steps)"), err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_mixing_that_the_data_cannot_take_is_one_line_in_the_launcher(capsys, tmp_path):
    code = main(["train", "--model", "torch-mlp", "--dataset", "digits", "--nproc", "2",
                 "--cutmix", "1.0", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err == ("dptrain train: error: cutmix pastes a box of one image into "
                                 "another; dataset digits has inputs of shape (64,), not "
                                 "(channels, height, width)"), err


def test_milestones_may_be_a_toml_array(tmp_path):
    from dptrain.cli.train import read_toml

    path = tmp_path / "run.toml"
    path.write_text('model = "torch-mlp"\nschedule = "multistep"\nmilestones = [30, 60, 80]\n')
    assert read_toml(path)["milestones"] == "30,60,80"
