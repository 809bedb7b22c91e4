"""`dptrain train --max-steps --val-every --val-batches` end to end on two processes: a job
SIGKILLed during training and while writing a validation point's checkpoint ends bit-identical
to an unbroken one, steps.csv, epochs.csv and best/ included; a job killed on two processes and
resumed on one validates at the same steps on the same samples (docs/design.md, contract 3;
steps: docs/howto/checkpoints.md)."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from dptrain.train import checkpoint as ckpt
from tests._cli import dptrain_cmd, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS, FEATURES = 600, 8  # a regression table read with numpy alone (no scikit-learn per worker)
TRAINED = 480 - 48  # less the test fraction (0.2) and --val-size (0.1)
BATCH, MAX_STEPS, EVERY = 32, 50, 10
PER_EPOCH = math.ceil(TRAINED / BATCH)  # 14: the run ends mid-epoch 4
COMMON = ["train", "--batch-size", str(BATCH), "--hidden", "16", "--max-steps", str(MAX_STEPS),
          "--val-every", str(EVERY), "--val-batches", "1", "--checkpoint-every", "4",
          "--keep-last", "100", "--no-progress"]


def _table(path: Path) -> str:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES))
    y = np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.1 * rng.normal(size=ROWS)
    np.savez(path, x=x, y=y)
    return f"npz:{path}"


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(600)
def test_a_killed_step_counted_job_ends_bit_identical_with_its_validation_points(tmp_path):
    """The default TAGI model (steps are every model's): killed before step 23 (between the
    points of 20 and 30, after step 20's checkpoint) and inside rank 0's write of step 40's
    checkpoint, a validation point's."""
    data = _table(tmp_path / "table.npz")
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    reference = run(dptrain_cmd(*COMMON, "--dataset", data, "--out", str(clean)), timeout_s=150)
    assert reference.returncode == 0, reference.output
    assert "after 50 step(s)" in reference.stdout and "best/ step " in reference.stdout
    result = run(dptrain_cmd(*COMMON, "--dataset", data, "--out", str(killed), "--fail-at",
                             "1:23,0:ckpt:40", "--max-restarts", "2"), timeout_s=400)
    assert result.returncode == 0, result.output
    assert re.findall(r"fault injection \(attempt (\d+)\)", result.stdout) == ["0", "1"]
    assert [int(s) for s in re.findall(r"resumed from \S+step-(\d+)", result.stdout)] == \
        [20, 36]

    summary, expected = _summary(killed), _summary(clean)
    assert summary["params_sha256"] == expected["params_sha256"]
    assert summary["steps"] == MAX_STEPS and summary["best_step"] == expected["best_step"]
    for name in ("steps.csv", "epochs.csv"):
        assert (killed / name).read_text() == (clean / name).read_text(), name
    rows = _rows(clean / "steps.csv")
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40, 50]
    best = min(rows, key=lambda r: float(r["val_rmse"]))
    assert int(best["step"]) == expected["best_step"]
    for run_dir in (clean, killed):
        assert ckpt.validate(run_dir / "checkpoints/best").meta["step"] == expected["best_step"]


@pytest.mark.timeout(600)
def test_killed_on_two_processes_resumed_on_one_validates_at_the_same_steps(tmp_path):
    """A torch model with its schedule in steps (warmup 5 steps, cosine to min-lr at step 40):
    killed before step 27 on two processes, resumed on one; every validation point, before
    and after the change, is at the unbroken two-process run's steps, on its samples (a
    different choice of 32 of the 48 validation samples would move val_rmse by far more than
    float summation order does), at its learning rate."""
    data = _table(tmp_path / "table.npz")
    torch_run = [*COMMON, "--dataset", data, "--model", "torch-mlp", "--schedule", "cosine",
                 "--warmup", "5", "--lr-decay-steps", "40", "--min-lr", "1e-4"]
    clean, moved = tmp_path / "clean", tmp_path / "moved"
    reference = run(dptrain_cmd(*torch_run, "--out", str(clean)), timeout_s=150)
    assert reference.returncode == 0, reference.output
    killed = run(dptrain_cmd(*torch_run, "--out", str(moved), "--fail-at", "0:27"),
                 timeout_s=150)
    assert killed.returncode != 0 and "fault injection" in killed.stdout, killed.output
    resumed = run(dptrain_cmd(*torch_run, "--out", str(moved), "--nproc", "1"), timeout_s=150)
    assert resumed.returncode == 0, resumed.output
    assert re.search(r"resumed from \S+step-00000024", resumed.stdout), resumed.output

    expected, rows = _rows(clean / "steps.csv"), _rows(moved / "steps.csv")
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == \
        [str(s) for s in range(EVERY, MAX_STEPS + 1, EVERY)]
    for row, reference_row in zip(rows, expected):
        assert row["samples"] == reference_row["samples"]
        assert float(row["lr"]) == pytest.approx(float(reference_row["lr"]), rel=1e-12)
        for name in ("val_rmse", "val_loss", "train_loss"):
            assert float(row[name]) == pytest.approx(float(reference_row[name]), rel=1e-3), \
                (row["step"], name)
    assert float(rows[-1]["lr"]) == 1e-4  # past --lr-decay-steps 40: min-lr
    summary = _summary(moved)
    assert summary["steps"] == MAX_STEPS and summary["world_size"] == 1
    assert summary["epochs_done"] == pytest.approx(MAX_STEPS / PER_EPOCH)
