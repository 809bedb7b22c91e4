"""`dptrain tune` with real trials (tiny TAGI runs on toy1d, one process each but where two are
the point): a forced prune stops its two-process run cleanly; a worker SIGKILLed mid-trial is taken over and its trial ends with the
parameters of an uninterrupted run (contract 3 through the search); two workers on one
journal or PostgreSQL study run distinct trials, exactly --max-trials."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from dptrain.train import checkpoint as ckpt  # noqa: E402
from dptrain.tune import SubprocessRunner, TuneOptions, tune  # noqa: E402

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
# train_rmse: the only non-test metric on this branch's toy1d runs (a validation metric once
# the runs report one); the tune refuses a test_* monitor.
TRAIN = ["--model", "tagi-mlp", "--dataset", "toy1d", "--nproc", "1", "--monitor", "train_rmse",
         "--hidden", "16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def runs_of(study: Path) -> list[int]:
    """Pids of processes whose command line names this study's directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(study).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def stop_all(study: Path) -> None:
    for pid in runs_of(study):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.dist
def test_forced_prune_stops_the_run_and_leaves_no_process(tmp_path):
    study = tmp_path / "study"
    started = []

    class Recording(SubprocessRunner):
        def start(self, run_dir, config):
            process = super().start(run_dir, config)
            started.append(process.popen.pid)
            return process

    options = TuneOptions(out=str(study), space=("sigma_v=float:0.1:0.5",), max_trials=1,
                          monitor="train_rmse")
    try:
        # two processes: torchrun's workers run in sessions of their own, out of reach of a
        # kill of the trial's session; dptrain train must stop them itself
        summary = tune(options, {"model": "tagi-mlp", "dataset": "toy1d", "nproc": 2,
                                 "hidden": 16, "epochs": 300},
                       runner=Recording(ENV), pruner=optuna.pruners.ThresholdPruner(upper=0.0),
                       say=lambda line: None)
    finally:
        stop_all(study)
    [trial] = rows(study / "trials.csv")
    assert trial["state"] == "PRUNED" and summary["pruned"] == 1
    assert 1 <= len(rows(study / "trial-0000" / "epochs.csv")) < 300
    assert runs_of(study) == []
    with pytest.raises(ProcessLookupError):
        os.kill(started[0], 0)


def tune_cmd(study: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dptrain", "tune", *TRAIN, "--out", str(study),
            "--space", "sigma_v=float:0.1:0.5", "--sampler-seed", "1", *extra]


def test_killed_worker_is_taken_over_and_ends_as_uninterrupted(tmp_path):
    study = tmp_path / "study"
    # enough epochs that the kill lands mid-run: a toy1d epoch takes milliseconds, and the
    # worker is killed up to a poll interval after the third one
    epochs_total = 200
    argv = tune_cmd(study, "--epochs", str(epochs_total), "--max-trials", "1", "--lease-s", "3")
    first = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    epochs = study / "trial-0000" / "epochs.csv"
    try:
        deadline = time.monotonic() + 120
        while not (epochs.exists() and len(rows(epochs)) >= 3):
            assert first.poll() is None and time.monotonic() < deadline, "no epoch in time"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # the worker dies; its run follows (PDEATHSIG)
        first.wait(timeout=10)
        deadline = time.monotonic() + 30
        while runs_of(study) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert runs_of(study) == [], "the dead worker's run outlived it"
        killed_at = len(rows(epochs))
        assert killed_at < epochs_total
        second = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stderr
    finally:
        stop_all(study)
    assert "lease expired" in second.stdout and "taken over" in second.stdout
    table = rows(study / "trials.csv")
    assert [(r["state"], r["resumes"], r["taken_over"]) for r in table] == [
        ("FAIL", "", "True"), ("COMPLETE", "0", "False")]
    summary = json.loads((study / "trial-0000" / "summary.json").read_text())
    assert summary["resumed_from"] and summary["final_epoch"] == epochs_total
    assert float(table[1]["value"]) == summary["best_train_rmse"]  # value = its summary.json
    # the same options, never interrupted
    plain = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "dptrain", "train", "--config",
                    str(study / "trial-0000" / "trial.toml"), "--out", str(plain),
                    "--no-progress"], env=ENV, check=True, capture_output=True, timeout=180)
    uninterrupted = json.loads((plain / "summary.json").read_text())
    assert summary["params_sha256"] == uninterrupted["params_sha256"]
    assert (study / "best.toml").exists() and (study / "tune.png").exists()


def _interruptible() -> None:
    """In the child before exec: SIGINT at its default, so Python raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_then_the_same_command_continues_the_study(tmp_path):
    """Ctrl-C stops the worker and its run and gives up the lease: the same command resumes the
    interrupted trial from its checkpoint at once (a 600 s lease is not waited for); no trial
    is repeated."""
    study = tmp_path / "study"
    epochs_total = 200  # the interrupt lands mid-run (a toy1d epoch takes milliseconds)
    argv = tune_cmd(study, "--epochs", str(epochs_total), "--max-trials", "1", "--lease-s",
                    "600")
    # Started as from a terminal, with Ctrl-C's signal at its default: a suite run as a
    # background job (`make test &`) has SIGINT ignored, every child inherits that, and the
    # study then never sees the interrupt and ends complete.
    first = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=_interruptible)
    epochs = study / "trial-0000" / "epochs.csv"
    checkpoints = study / "trial-0000" / "checkpoints"
    try:
        deadline = time.monotonic() + 120
        # An epoch's row is written before its checkpoint, which is published in the
        # background (async checkpoints): a row alone does not mean there is anything to
        # resume from, and a signal sent then may stop the run before its first checkpoint
        # is published (the trial then rightly starts afresh). Wait for a published one.
        while not (epochs.exists() and len(rows(epochs)) >= 2 and
                   ckpt.list_steps(checkpoints)):
            assert first.poll() is None and time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
        assert first.returncode == 130 and "interrupted" in err, (first.returncode, err[-3000:])
        assert runs_of(study) == []
        # within 180 s: waiting for the 600 s lease would time out
        second = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stderr
    finally:
        if first.poll() is None:
            first.kill()
        stop_all(study)
    table = rows(study / "trials.csv")
    assert [(r["state"], r["resumes"]) for r in table] == [("FAIL", ""), ("COMPLETE", "0")]
    summary = json.loads((study / "trial-0000" / "summary.json").read_text())
    assert summary["resumed_from"] and summary["final_epoch"] == epochs_total
    assert not (study / "trial-0001").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres():
    """A PostgreSQL server of our own, as a non-root user (the server refuses root)."""
    bindir = next((d for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None) \
        if Path("/usr/lib/postgresql").exists() else None
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (make test installs it)")
    data = Path(tempfile.mkdtemp(prefix="dptrain-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=60)

    run(str(bindir / "initdb"), "-D", str(data / "db"), "-U", "dptrain", "--auth=trust")
    run(str(bindir / "pg_ctl"), "-D", str(data / "db"), "-l", str(data / "log"), "-w", "-o",
        f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start")
    try:
        yield f"postgresql://dptrain@127.0.0.1:{port}/postgres"
    finally:
        run(str(bindir / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop")
        shutil.rmtree(data, ignore_errors=True)


def two_workers(study: Path, *extra: str) -> None:
    """The same command twice at once on one study: 3 trials of 2 epochs between them."""
    argv = tune_cmd(study, "--epochs", "2", "--max-trials", "3", "--pruner", "none", *extra)
    workers = [subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True) for _ in range(2)]
    try:
        outs = [w.communicate(timeout=240) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        stop_all(study)
    errors = "\n".join(o[1][-2000:] for o in outs)
    assert [w.returncode for w in workers] == [0, 0], errors


def check_distinct(trials: list) -> None:
    real = [t for t in trials if "void" not in t.user_attrs]
    assert len(real) == 3 and all(t.state.name == "COMPLETE" for t in real)
    assert len({t.user_attrs["run_dir"] for t in real}) == 3
    assert len({t.user_attrs["worker"] for t in real}) == 2  # both workers pulled trials
    for t in real:  # a trial's value is its run's summary.json
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert t.value == summary["best_train_rmse"]


def test_two_workers_on_one_journal_run_distinct_trials_exactly_max_trials(tmp_path):
    study = tmp_path / "study"
    two_workers(study)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(study / "study.journal")))
    check_distinct(optuna.load_study(study_name="study", storage=storage).get_trials())
    assert len(rows(study / "trials.csv")) == 3


def test_two_workers_on_postgresql_run_distinct_trials_exactly_max_trials(tmp_path, postgres):
    two_workers(tmp_path / "study", "--storage", postgres)
    storage = optuna.storages.RDBStorage(postgres.replace("postgresql://",
                                                          "postgresql+psycopg://"))
    try:
        check_distinct(optuna.load_study(study_name="study", storage=storage).get_trials())
    finally:
        storage.remove_session()
        storage.engine.dispose()
