"""`dptrain train` end to end: the main job, exact resume after SIGKILL, broken checkpoints,
early stopping, regression outputs (docs/design.md, contracts 3 and 6)."""

from __future__ import annotations

import re

import csv
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dptrain.cli.main import main
from dptrain.train import checkpoint as ckpt
from tests._cli import REPO, base_env, dptrain_cmd, run, stop

pytestmark = pytest.mark.e2e


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _epochs(out: Path) -> list[dict]:
    with open(out / "epochs.csv") as f:
        return list(csv.DictReader(f))


def _readme_demo_output() -> tuple[str, str]:
    """The last epoch line of the README's `make demo` output, and its "done:" line (the
    recording machine's, bench/results/demo.json)."""
    block = (REPO / "README.md").read_text().split("It ends like this", 1)[1].split("```")[1]
    lines = block.strip().splitlines()
    epoch = next(line for line in lines if line.startswith("epoch 10/10"))
    done = next(line for line in lines if line.startswith("done:"))
    return epoch, done


def _metrics(epoch_line: str) -> dict[str, float]:
    """`epoch 10/10  step 410  train_error 0  ...` as {"step": 410, "train_error": 0, ...}."""
    words = epoch_line.split()[2:]
    return {name: float(value) for name, value in zip(words[::2], words[1::2])}


# How far another CPU's float32 kernels may move the demo's last-epoch metrics: a few of the
# 360 test samples, and the likelihoods and ECE by as much. On one machine the run is
# deterministic (2 ranks, one thread each); the README's figures are one machine's.
DEMO_TOLERANCE = {"error": 0.015, "log_likelihood": 0.05, "ece": 0.02}


@pytest.mark.recorded
def test_default_main_job_trains_digits_on_two_processes(tmp_path):
    """The README's main job with its defaults prints what the README shows: the same metrics
    at the same step, each within DEMO_TOLERANCE of the README's (bench/demo.py re-records
    them), and the same "done:" line up to its figures."""
    out = tmp_path / "run"
    result = run(dptrain_cmd("train", "--out", str(out), "--checkpoint-every", "40"),
                 timeout_s=240)
    assert result.returncode == 0, result.output
    assert "done: test_error" in result.stdout and f"run directory: {out}" in result.stdout
    epoch_line, done_line = _readme_demo_output()
    printed = next(line for line in result.stdout.splitlines() if line.startswith("epoch 10/10"))
    expected, got = _metrics(epoch_line), _metrics(printed)
    assert list(got) == list(expected) and got["step"] == expected["step"], printed
    for name, value in expected.items():
        if name != "step":
            tolerance = next(t for kind, t in DEMO_TOLERANCE.items() if name.endswith(kind))
            assert abs(got[name] - value) <= tolerance, (name, got[name], value)
    done = next(line for line in result.stdout.splitlines() if line.startswith("done:"))
    shape = re.compile(r"[0-9.]+")
    assert shape.sub("#", done.split(" samples/s")[0]) == \
        shape.sub("#", done_line.split(" samples/s")[0]), done
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["final_epoch"] == 10
    assert len(summary["params_sha256"]) == 64
    assert [int(r["epoch"]) for r in _epochs(out)] == list(range(1, 11))
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "best" / "meta.json").exists()
    assert len(list((out / "checkpoints").glob("step-*"))) == 3  # keep_last


def test_a_rank_killed_mid_epoch_resumes_bit_exactly(tmp_path):
    """Contract 3: SIGKILL rank 1 at step 25 (mid-epoch 1, last checkpoint at step 20); torchrun
    restarts the job, it resumes from the checkpoint and ends with the same parameters."""
    common = ["train", "--epochs", "2", "--checkpoint-every", "10", "--no-progress"]
    clean = run(dptrain_cmd(*common, "--out", str(tmp_path / "clean")), timeout_s=180)
    assert clean.returncode == 0, clean.output
    killed = run(dptrain_cmd(*common, "--out", str(tmp_path / "killed"), "--fail-at", "1:25",
                             "--max-restarts", "1"), timeout_s=240)
    assert killed.returncode == 0, killed.output
    assert "[rank 1] fault injection (attempt 0): SIGKILL at step 25" in killed.output
    # One line for the lost rank and the step; the survivor (rank 0) prints nothing.
    assert killed.stderr.splitlines() == [
        "dptrain train: rank 1 failed (exit code -9, SIGKILL) at step 25; restarting every "
        "worker (1 restart(s) left)"], killed.stderr
    assert "resumed from" in killed.stdout and "step-00000020" in killed.stdout
    assert _summary(tmp_path / "killed")["params_sha256"] == \
        _summary(tmp_path / "clean")["params_sha256"]
    assert len(_epochs(tmp_path / "killed")) == 2


def test_a_dropout_model_killed_mid_epoch_resumes_with_its_rng_and_its_epoch_metrics(tmp_path):
    """The RNG restore, exercised: dropout draws from every rank's generator while training, so
    only restored generators give the same masks, hence the same parameters. And the resumed
    epoch's train metrics cover its steps before the kill too (kept in the checkpoint), so
    epochs.csv equals the uninterrupted run's, byte for byte."""
    common = ["train", "--model", "torch-mlp", "--dropout", "0.3", "--hidden", "32",
              "--epochs", "1", "--batch-size", "64", "--checkpoint-every", "8", "--no-progress"]
    clean = run(dptrain_cmd(*common, "--out", str(tmp_path / "clean")), timeout_s=180)
    assert clean.returncode == 0, clean.output
    killed = run(dptrain_cmd(*common, "--out", str(tmp_path / "killed"), "--fail-at", "1:13",
                             "--max-restarts", "1"), timeout_s=240)
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.stdout and "step-00000008" in killed.stdout
    assert _summary(tmp_path / "killed")["params_sha256"] == \
        _summary(tmp_path / "clean")["params_sha256"]
    assert (tmp_path / "killed" / "epochs.csv").read_text() == \
        (tmp_path / "clean" / "epochs.csv").read_text()


def test_without_restarts_a_killed_rank_fails_the_job_naming_it(tmp_path):
    """Rank 0, the one that serves the rendezvous store, is killed: the survivor neither prints
    a traceback nor the store client's C++ trace; the job's stderr is one line naming the lost
    rank and the step."""
    result = run(dptrain_cmd("train", "--epochs", "1", "--no-progress", "--out",
                             str(tmp_path / "r"), "--fail-at", "0:3"), timeout_s=180)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dptrain train: rank 0 failed first (exit code -9) at step 3 "
                               "(rank(s) 1 failed after it) and the job was stopped. Its error: "
                               "Signal 9 (SIGKILL)"), lines


def _train_in_process(out: Path, *extra: str) -> int:
    return main(["train", "--nproc", "1", "--out", str(out), "--no-progress", *extra])


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_still_ends_exactly(tmp_path, capsys):
    assert _train_in_process(tmp_path / "clean", "--epochs", "3") == 0
    assert _train_in_process(tmp_path / "r", "--epochs", "2") == 0
    newest = sorted((tmp_path / "r" / "checkpoints").glob("step-*"))[-1]
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated, as a full disk would leave it
    capsys.readouterr()
    assert _train_in_process(tmp_path / "r", "--epochs", "3") == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and newest.name not in out.split("resumed from")[1][:80]
    assert _summary(tmp_path / "r")["params_sha256"] == \
        _summary(tmp_path / "clean")["params_sha256"]


def test_early_stopping_stops_after_patience_epochs_without_improvement(tmp_path):
    out = tmp_path / "es"
    assert _train_in_process(out, "--epochs", "30", "--patience", "2", "--batch-size",
                             "256") == 0
    errors = [float(r["val_error"]) for r in _epochs(out)]  # validation chooses
    best, bad, expected_stop = float("inf"), 0, len(errors)
    for epoch, e in enumerate(errors, 1):
        best, bad = (e, 0) if e < best else (best, bad + 1)
        if bad == 2:
            expected_stop = epoch
            break
    assert len(errors) == expected_stop < 30
    summary = _summary(out)
    assert summary["stopped_early"] and summary["best_val_error"] == min(errors)


def test_regression_writes_rmse_log_likelihood_and_the_band_plot(tmp_path):
    out = tmp_path / "toy"
    assert _train_in_process(out, "--dataset", "toy1d", "--epochs", "40", "--batch-size", "4",
                             "--sigma-v", "0.3", "--hidden", "50") == 0
    summary = _summary(out)
    assert summary["test_rmse"] > 0 and "test_log_likelihood" in summary
    assert (out / "predictions.png").stat().st_size > 1000


def test_torch_recipe_through_the_same_trainer(tmp_path):
    out = tmp_path / "torch"
    assert _train_in_process(out, "--model", "torch-mlp", "--epochs", "2",
                             "--accumulation-steps", "2") == 0
    summary = _summary(out)
    assert summary["test_error"] < 0.15 and (out / "checkpoints" / "best").is_dir()
    assert _train_in_process(tmp_path / "bad", "--model", "torch-cnn", "--dataset",
                             "diabetes") == 2  # a clear ConfigError, not a shape crash


FSDP_RUN = ["train", "--model", "torch-mlp", "--strategy", "fsdp", "--epochs", "1",
            "--batch-size", "64", "--checkpoint-every", "8", "--no-progress"]


@pytest.fixture(scope="module")
def fsdp_clean(tmp_path_factory) -> dict:
    """The summary of the sharded run below, never killed."""
    out = tmp_path_factory.mktemp("fsdp") / "clean"
    clean = run(dptrain_cmd(*FSDP_RUN, "--out", str(out)), timeout_s=180)
    assert clean.returncode == 0, clean.output
    return _summary(out)


def test_sharded_fsdp_run_killed_mid_epoch_resumes_bit_exactly(tmp_path, fsdp_clean):
    """Contract 3 for a sharded learner: every rank writes its shard through
    torch.distributed.checkpoint into the same atomic step folder, and a restart resumes it."""
    killed = run(dptrain_cmd(*FSDP_RUN, "--out", str(tmp_path / "killed"), "--fail-at", "0:13",
                             "--max-restarts", "1"), timeout_s=240)
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.stdout and "step-00000008" in killed.stdout
    assert (tmp_path / "killed" / "checkpoints" / "step-00000016" / "sharded").is_dir()
    assert _summary(tmp_path / "killed")["params_sha256"] == fsdp_clean["params_sha256"]


def test_sharded_fsdp_run_killed_in_its_background_write_resumes_bit_exactly(tmp_path,
                                                                              fsdp_clean):
    """Contract 3 with the shards written in the background: rank 0 is SIGKILLed in its
    writer's thread once every rank's shards of step 16 and its state file are written, before
    it publishes them (what a crash there leaves is the most complete-looking partial folder);
    the restart resumes from step 8 and ends as the run that was never killed."""
    out = tmp_path / "killed"
    killed = run(dptrain_cmd(*FSDP_RUN, "--out", str(out), "--fail-at", "0:ckpt:16",
                             "--max-restarts", "1"), timeout_s=240)
    assert killed.returncode == 0, killed.output
    assert "[rank 0] fault injection (attempt 0): SIGKILL while writing the checkpoint of " \
        "step 16" in killed.output
    assert "resumed from" in killed.stdout and "step-00000008" in killed.stdout
    assert ckpt.validate(out / "checkpoints" / "step-00000016").meta["sharded"]  # rewritten
    assert _summary(out)["params_sha256"] == fsdp_clean["params_sha256"]


def test_sigterm_stops_the_job_quietly_with_status_143(tmp_path):
    """A scheduler's SIGTERM (a cancelled job, a pre-empted node) ends `dptrain train` as a shell
    expects: status 128 + 15, one line, no traceback from torch's agent."""
    out = tmp_path / "r"
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(dptrain_cmd("train", "--epochs", "1000", "--no-progress", "--out",
                                        str(out)), cwd=REPO, env=base_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "epochs.csv").exists():  # the workers are training
            assert time.monotonic() < deadline and proc.poll() is None, \
                (tmp_path / "train.log").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        stop(proc)
        log.close()
    output = (tmp_path / "train.log").read_text()
    assert proc.returncode == 143, output
    assert "dptrain train: stopped by SIGTERM" in output
    assert "Traceback" not in output, output


def test_under_torchrun_without_out_a_restarted_attempt_finds_its_run_directory(tmp_path):
    """torchrun without --rdzv-id names no job (run id "none"): rank 0 names the directory after
    the agent's start time, which the restarted attempt shares, and so it resumes. (A job id, when
    there is one, names it instead: see test_train_options.)"""
    from tests._cli import PYTHON, base_env
    from tests._world import free_port

    cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--max-restarts=1", "-m", "dptrain", "train",
           "--epochs", "1", "--hidden", "16", "--batch-size", "64", "--checkpoint-every", "5",
           "--no-progress"]
    env = base_env(DPTRAIN_FAIL_AT="1:7", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    result = run(cmd, env=env, cwd=tmp_path, timeout_s=240)
    assert result.returncode == 0, result.output
    assert "fault injection (attempt 0): SIGKILL at step 7" in result.output
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("tagi-mlp-digits-"), dirs
    assert "resumed from" in result.stdout and "step-00000005" in result.stdout
