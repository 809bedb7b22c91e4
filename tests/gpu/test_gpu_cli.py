"""`dptrain train` end to end on the device it picks: CUDA wherever torch sees enough GPUs for
the processes (NCCL, one GPU per process: docs/design.md, dist/group.py's `choose_backend`),
else the CPU. One process per GPU on a CUDA machine, one process on the CPU; one epoch of the
digit images, then the run's own summary."""

from __future__ import annotations

import json

import pytest
import torch

from tests._cli import base_env, dptrain_cmd, run
from tests.gpu.conftest import DEVICES

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["tagi-cnn", "torch-cnn"])
def test_train_runs_on_the_device_the_runtime_picks(model, device, tmp_path):
    """On a CUDA machine the command itself must choose CUDA (nothing here asks for it); on
    the CPU run, CUDA is hidden so that the same command takes the CPU path."""
    nproc = max(1, torch.cuda.device_count()) if device == "cuda" else 1
    env = base_env() if device == "cuda" else base_env(CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "run"
    result = run(dptrain_cmd("train", "--model", model, "--dataset", "digits-image",
                             "--nproc", str(nproc), "--epochs", "1", "--batch-size", "32",
                             "--no-progress", "--out", str(out)),
                 timeout_s=300, env=env)
    assert result.returncode == 0, result.output
    backend = "nccl" if device == "cuda" and nproc > 1 else "no group"
    assert f"{nproc} process(es) (" in result.stdout and f", {backend}) on {device}," in \
        result.stdout, result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == nproc and summary["final_epoch"] == 1
    assert summary["test_error"] < 0.5, summary["test_error"]  # learned: 90 % are wrong by chance
