"""Documented claims about `dptrain train` options that no other test holds: `DPTRAIN_FAIL_AT`,
`--timeout` bounding the start-up rendezvous in one line, and `--monitor` (docs/design.md,
contract 4)."""

from __future__ import annotations

import csv
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dptrain.cli.main import main
from tests._cli import base_env, dptrain_cmd, run
from tests._world import free_port

pytestmark = pytest.mark.e2e


def _epochs(out: Path) -> list[dict]:
    with open(out / "epochs.csv") as f:
        return list(csv.DictReader(f))


def test_dptrain_fail_at_variable_kills_that_rank_in_the_first_attempt_only(tmp_path):
    """`DPTRAIN_FAIL_AT=RANK:STEP` does what `--fail-at` does: SIGKILL before that step, unless
    the job is already a restarted attempt (torchrun's TORCHELASTIC_RESTART_COUNT > 0)."""
    args = ("train", "--nproc", "1", "--epochs", "1", "--batch-size", "256", "--no-progress")
    killed = run(dptrain_cmd(*args, "--out", str(tmp_path / "killed")), timeout_s=120,
                 env=base_env(DPTRAIN_FAIL_AT="0:3"))
    assert killed.returncode == -9, killed.output
    assert "[rank 0] fault injection (attempt 0): SIGKILL at step 3" in killed.stdout
    assert not (tmp_path / "killed" / "summary.json").exists()

    restarted = run(dptrain_cmd(*args, "--out", str(tmp_path / "restarted")), timeout_s=120,
                    env=base_env(DPTRAIN_FAIL_AT="0:3", TORCHELASTIC_RESTART_COUNT="1"))
    assert restarted.returncode == 0, restarted.output
    assert "fault injection" not in restarted.output
    assert (tmp_path / "restarted" / "summary.json").is_file()


def _lone_rank(rank: int, out: Path) -> tuple[object, float]:
    """Rank `rank` of a 2-rank job whose other rank never starts, with --timeout 3."""
    env = base_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    start = time.monotonic()
    result = run(dptrain_cmd("train", "--timeout", "3", "--epochs", "1", "--no-progress",
                             "--out", str(out)), timeout_s=90, env=env)
    return result, time.monotonic() - start


def test_timeout_bounds_the_start_up_rendezvous(tmp_path):
    """A rank whose peer never arrives gives up after --timeout seconds (default 300) with one
    line naming itself, the world and the address; rank 0 (which serves the store) and rank 1
    (which dials it) alike. The 90 s deadline fails the test if the 300 s default applied."""
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda r: _lone_rank(r, tmp_path / f"rank{r}"), (0, 1)))
    for rank, (result, seconds) in enumerate(outcomes):
        assert result.returncode == 5, result.output  # RankFailure
        # Our line alone: no C++ trace of the store client retrying (rank 1) before it.
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(
            f"dptrain train: error: rank {rank}: could not start the gloo process group of 2 "
            f"ranks at 127.0.0.1:"), result.output
        assert "within 0:00:03" in result.stderr
        assert seconds < 60, seconds


def test_monitor_chooses_the_early_stopping_metric_and_its_direction(tmp_path, capsys):
    """--monitor val_log_likelihood: higher is better, patience counts epochs without a new
    maximum, summary.json reports that metric's best, and best/ holds the best epoch."""
    out = tmp_path / "ll"
    assert main(["train", "--nproc", "1", "--out", str(out), "--no-progress", "--epochs", "30",
                 "--batch-size", "256", "--monitor", "val_log_likelihood",
                 "--patience", "1"]) == 0
    rows = _epochs(out)
    values = [float(r["val_log_likelihood"]) for r in rows]
    # patience 1: stop at the first epoch that does not beat the best so far
    stop = next(i for i in range(1, len(values)) if values[i] <= max(values[:i])) + 1
    assert len(values) == stop < 30
    best_epoch = values.index(max(values)) + 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["best_epoch"] == best_epoch
    assert summary["best_val_log_likelihood"] == max(values)
    best_meta = json.loads((out / "checkpoints" / "best" / "meta.json").read_text())
    assert best_meta["step"] == int(rows[best_epoch - 1]["step"])

    capsys.readouterr()
    assert main(["train", "--nproc", "1", "--out", str(tmp_path / "bad"), "--no-progress",
                 "--epochs", "1", "--batch-size", "256", "--monitor", "val_accuracy"]) == 2
    captured = capsys.readouterr()
    assert "--monitor 'val_accuracy' is not a metric of this run (tagi-mlp on digits); it " \
        "reports: test_ece, test_error, test_log_likelihood, train_error, " \
        "train_log_likelihood, val_ece, val_error, val_log_likelihood" in captured.err
    assert "epoch 1/1" not in captured.out  # refused before training


def test_an_unknown_monitor_is_refused_before_any_worker_starts(tmp_path):
    out = tmp_path / "bad"
    result = run(dptrain_cmd("train", "--nproc", "2", "--model", "torch-mlp", "--out", str(out),
                             "--monitor", "val_log_likelihood"), timeout_s=120)
    assert result.returncode == 2, result.output
    assert "--monitor 'val_log_likelihood' is not a metric of this run (torch-mlp on " \
        "digits); it reports: test_ece, test_error, test_loss, train_error, train_loss, " \
        "val_ece, val_error, val_loss" in result.stderr, result.output
    assert "process(es)" not in result.stdout  # no worker said hello
    assert not (out / "options.json").exists()
