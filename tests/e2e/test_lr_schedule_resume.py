"""A torch run trained the way the field does (SGD with Nesterov momentum, weight decay without
norms and biases, linear lr scaling, warmup then cosine, clipping, EMA) is exact after kills
and the same on any world size (docs/reference/gradient_learner.md, Optimizers and schedules; the
schedule is a function of the global optimizer step):

- killed during warmup and again during the cosine decay, restarted by the job each time, it
  ends bit-identical to the uninterrupted run: parameters, EMA weights, learning-rate trace;
- on 1 process it applies the same learning rate at every step as on 2;
- killed on 2 processes and finished on 1, it keeps that trace.

The trace is TensorBoard's `step/lr` (every optimizer step, every attempt's event file) and
epochs.csv's lr column.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from dptrain.cli.main import main
from tests._cli import dptrain_cmd, run

pytestmark = pytest.mark.e2e

ROWS, BATCH, EPOCHS = 660, 32, 3
STEPS = 3 * 15  # 528 training rows, 48 of them validate: 480 at batch 32, 15 steps per epoch;
# warmup = steps 0..14
RECIPE = ["--model", "torch-mlp", "--hidden", "16", "--epochs", str(EPOCHS), "--batch-size",
          str(BATCH), "--optimizer", "sgd", "--momentum", "0.9", "--nesterov",
          "--weight-decay", "1e-4", "--lr", "0.025", "--lr-batch", "16", "--lr-scaling",
          "linear", "--warmup", "1", "--warmup-start", "0.1", "--schedule", "cosine",
          "--min-lr", "1e-4", "--clip-grad-norm", "5", "--ema", "0.9", "--ema-every", "2",
          "--checkpoint-every", "3", "--keep-last", "100", "--val-size", "48", "--no-progress"]


def _table(path: Path) -> str:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6))
    np.savez(path, x=x, y=np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2])
    return f"npz:{path}"


def lr_trace(run_dir: Path) -> dict[int, float]:
    """step -> learning rate from every event file in the run's tb/ (each attempt wrote one;
    a resumed attempt logs again the steps after its checkpoint, with the same values)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    trace: dict[int, float] = {}
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "step/lr":
                    got = value.simple_value if value.HasField("simple_value") else \
                        float(np.frombuffer(value.tensor.tensor_content, np.float32)[0]
                              if value.tensor.tensor_content else value.tensor.float_val[0])
                    assert trace.setdefault(event.step, got) == got, (path, event.step)
    return trace


def _epoch_lrs(run_dir: Path) -> list[str]:
    with open(run_dir / "epochs.csv") as f:
        return [row["lr"] for row in csv.DictReader(f)]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _job(out: Path, data: str, nproc: int, *extra: str, timeout_s: float = 180):
    return run(dptrain_cmd("train", *RECIPE, "--dataset", data, "--nproc", str(nproc),
                           "--out", str(out), *extra), timeout_s=timeout_s)


@pytest.mark.timeout(500)
def test_killed_in_warmup_and_in_decay_resized_or_not_the_lr_trace_and_weights_are_exact(
        tmp_path):
    data = _table(tmp_path / "table.npz")
    clean = _job(tmp_path / "clean", data, 2)
    assert clean.returncode == 0, clean.output
    # The scaled peak, said at the start: 0.025 x 32 / 16.
    assert "learning rate: peak 0.05 (0.025 at batch 16, linear scaling to batch 32)" \
        in clean.stdout, clean.output
    expected = _summary(tmp_path / "clean")
    assert expected["config"]["record"]["peak_lr"] == pytest.approx(0.05)
    trace = lr_trace(tmp_path / "clean")
    assert sorted(trace) == list(range(1, STEPS + 1))
    assert trace[1] == pytest.approx(0.005) and trace[16] == pytest.approx(0.05)  # warmup, peak
    assert trace[STEPS] < trace[30] < trace[16]  # cosine decay
    assert expected["ema_sha256"] != expected["params_sha256"]
    # With EMA the averaged model is the run's: monitored (best/), and what load_run loads.
    assert expected["monitor"] == "val_ema_rmse" and expected["best_val_ema_rmse"] is not None
    from dptrain.fingerprint import params_sha256
    from dptrain.inference import load_run
    assert params_sha256(load_run(tmp_path / "clean", which="last").model.state_dict()) == \
        expected["ema_sha256"]

    # Killed before step 8 (warmup; resumes from step 6) and before step 34 (decay; from 33).
    killed = _job(tmp_path / "killed", data, 2, "--fail-at", "1:8,0:34", "--max-restarts", "2",
                  timeout_s=300)
    assert killed.returncode == 0, killed.output
    assert killed.stdout.count("resumed from") == 2, killed.output
    got = _summary(tmp_path / "killed")
    assert got["params_sha256"] == expected["params_sha256"]
    assert got["ema_sha256"] == expected["ema_sha256"]
    assert lr_trace(tmp_path / "killed") == trace
    assert _epoch_lrs(tmp_path / "killed") == _epoch_lrs(tmp_path / "clean")

    # One process: the same rate at every step (the weights differ by float summation order).
    assert main(["train", *RECIPE, "--dataset", data, "--nproc", "1", "--out",
                 str(tmp_path / "one")]) == 0
    assert lr_trace(tmp_path / "one") == trace
    assert _epoch_lrs(tmp_path / "one") == _epoch_lrs(tmp_path / "clean")

    # Killed on 2 processes (decay, step 20; checkpoint at 18), finished on 1.
    resized = tmp_path / "resized"
    first = _job(resized, data, 2, "--fail-at", "0:20")
    assert first.returncode != 0 and "SIGKILL at step 20" in first.output, first.output
    assert main(["train", *RECIPE, "--dataset", data, "--nproc", "1", "--out",
                 str(resized)]) == 0
    assert _summary(resized)["resumed_from"].endswith("step-00000018")
    assert lr_trace(resized) == trace
    assert _epoch_lrs(resized) == _epoch_lrs(tmp_path / "clean")
