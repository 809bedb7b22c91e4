"""`dptrain train` on image files in the real formats (MNIST IDX, CIFAR-10 python batches), two
processes: built-in CNNs and ResNets, exact resume with augmentation and a σ_v schedule, the
user's own model file, and the one-line errors that arrive before any worker starts.

Everything is tiny (≤ 64 images, one epoch, ResNets of width 4): TAGI ResNet18 trains at a few
samples per second per process here."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from dptrain.cli.main import main
from dptrain.inference import load_run
from dptrain.models.user_file import model_file_sha256
from dptrain.data.datasets.synthetic import write_synthetic_cifar10, write_synthetic_mnist
from tests._cli import dptrain_cmd, run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("images")
    return {"mnist": write_synthetic_mnist(root / "mnist", num_train=64, num_test=32),
            "cifar10": write_synthetic_cifar10(root / "cifar", num_train=32, num_test=16)}


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _train(out: Path, *args: str, timeout_s: float = 150):
    return run(dptrain_cmd("train", "--epochs", "1", "--batch-size", "16", "--no-progress",
                           "--out", str(out), *args), timeout_s=timeout_s)


@pytest.mark.parametrize("model, dataset", [
    ("torch-resnet18", "cifar10"), ("tagi-resnet18", "cifar10")])  # tagi-cnn: in the next test
def test_builtin_image_models_train_on_two_processes(tmp_path, data, model, dataset):
    out = tmp_path / model
    result = _train(out, "--model", model, "--dataset", f"{dataset}:{data[dataset]}",
                    "--width", "4")
    assert result.returncode == 0, result.output
    assert "done: test_error" in result.stdout
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["final_epoch"] == 1
    assert 0 <= summary["test_error"] <= 1
    # the trained model, in one process, reproduces the run's own test metric
    table = tmp_path / "predictions.csv"
    assert main(["predict", str(out), "--out", str(table)]) == 0
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == (32 if dataset == "mnist" else 16)
    wrong = sum(r["label"] != r["predicted"] for r in rows)
    assert wrong / len(rows) == pytest.approx(summary["test_error"], abs=1e-12)
    if model.startswith("tagi"):
        assert all(float(r["p0_var"]) >= 0 for r in rows)


def test_killed_run_resumes_bit_exactly_with_augmentation_and_sigma_v_schedule(tmp_path, data):
    """tagi-cnn on MNIST files, and contract 3 with per-epoch state outside the model: the
    crop/flip draws of epoch 2 and σ_v of epoch 2 must be those of an uninterrupted run after a
    SIGKILL mid-epoch 2 (resumed from step 6 of 8)."""
    common = ["--model", "tagi-cnn", "--dataset", f"mnist:{data['mnist']}", "--augment",
              "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "2", "--sigma-v",
              "0.3", "--sigma-v-decay", "0.5", "--sigma-v-min", "0.1"]
    clean = _train(tmp_path / "clean", *common)
    assert clean.returncode == 0, clean.output
    assert "done: test_error" in clean.stdout
    summary = _summary(tmp_path / "clean")
    assert summary["world_size"] == 2 and summary["final_epoch"] == 2
    killed = _train(tmp_path / "killed", *common, "--fail-at", "1:7", "--max-restarts", "1",
                    timeout_s=200)
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.stdout and "step-00000006" in killed.stdout
    assert _summary(tmp_path / "killed")["params_sha256"] == summary["params_sha256"]
    state = torch.load(tmp_path / "killed" / "checkpoints" / "step-00000008" / "state.pt",
                       weights_only=True)
    assert state["learner"]["sigma_v"]["current"] == pytest.approx(0.15)  # 0.3 · 0.5¹


USER_MODELS = '''
import torch
from dptrain.tagi import AvgPool2d, Conv2d, Linear, ReLU, Sequential

def tagi_cnn(input_shape, num_outputs):
    c, h, w = input_shape
    return Sequential(Conv2d(c, 4, 3, padding=1), ReLU(), AvgPool2d(4),
                      Linear(4 * (h // 4) * (w // 4), num_outputs))

def torch_cnn(input_shape, num_outputs):
    c, h, w = input_shape
    return torch.nn.Sequential(torch.nn.Conv2d(c, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * h * w, num_outputs))

def wrong_width(input_shape, num_outputs):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 3))
'''


def test_user_model_files_train_and_bad_ones_fail_before_workers_start(tmp_path, data, capsys):
    path = tmp_path / "my_models.py"
    path.write_text(USER_MODELS)
    mnist = f"mnist:{data['mnist']}"
    for function in ("tagi_cnn", "torch_cnn"):  # one process: the model, not the launch
        out = tmp_path / function
        assert main(["train", "--model", f"{path}:{function}", "--dataset", mnist, "--nproc",
                     "1", "--epochs", "1", "--batch-size", "16", "--no-progress", "--out",
                     str(out)]) == 0
        assert "done: test_error" in capsys.readouterr().out
        record = _summary(out)["config"]["run_record"]
        assert record["model_sha256"] == model_file_sha256(path)
        assert load_run(out).kind == ("tagi" if function == "tagi_cnn" else "torch")
    for model, dataset, message in [
        (f"{tmp_path}/absent.py:f", mnist, "model file not found"),
        (f"{path}:nothing", mnist, "has no function 'nothing'"),
        (f"{path}:wrong_width", mnist, "outputs 3 values per sample, the learner needs 10"),
        ("tagi-cnn", "diabetes", "model tagi-cnn takes images"),
        ("torch-resnet18", mnist, "multiple of 8 pixels"),
    ]:
        # in this process: the check runs in the parent, before it would launch 2 workers
        status = main(["train", "--model", model, "--dataset", dataset, "--nproc", "2",
                       "--out", str(tmp_path / "bad"), "--no-progress"])
        err = capsys.readouterr().err
        assert status == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], err
        assert lines[0].startswith("dptrain train: error:")
        assert not (tmp_path / "bad" / "options.json").exists()  # no worker was launched


def test_load_run_predicts_regression_in_data_units(tmp_path, capsys):
    import dptrain

    out = tmp_path / "toy"
    assert main(["train", "--dataset", "toy1d", "--nproc", "1", "--epochs", "3",
                 "--batch-size", "4", "--sigma-v", "0.3", "--hidden", "16", "--no-progress",
                 "--out", str(out)]) == 0
    run = dptrain.load_run(out, which="last")
    prediction = run.predict_split(run.load_data())
    rmse = ((prediction.mean - prediction.targets) ** 2).mean().sqrt().item()
    assert rmse == pytest.approx(_summary(out)["test_rmse"], rel=1e-5)
    assert (prediction.var > 0.3 ** 2 * run.y_norm.std ** 2 * 0.999).all()  # σ_v² in data units
    raw_x = run.load_data().x_norm.invert(run.load_data().test.x[:5])
    mean, var = run.predict(raw_x)
    torch.testing.assert_close(mean, prediction.mean[:5])
