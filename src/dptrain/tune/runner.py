"""How a trial's run is started and stopped: one `dptrain train` command in a process of its
own (the search never trains in its own process, and the training processes never import
Optuna). Tests pass another `Runner` (a fake one that writes what a run writes).

    process = SubprocessRunner().start(Path("runs/s/trial-0003"), Path(".../trial.toml"))
    process.poll()      # None while it runs, then its exit code
    process.stop()      # SIGTERM, then SIGKILL after a grace period: nothing is left running
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Protocol

STOP_GRACE_S = 30.0
"""How long a stopped run may take to stop its workers before they are killed."""


class TrialProcess(Protocol):
    def poll(self) -> int | None:
        """None while the run goes on, then its exit code."""

    def stop(self) -> int:
        """Stop the run and every process it started; its exit code."""


class Runner(Protocol):
    def start(self, run_dir: Path, config: Path) -> TrialProcess:
        """Start `dptrain train --config CONFIG --out RUN_DIR` (resuming what RUN_DIR holds)."""


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the worker that started it dies (SIGKILL, a lost
    node), so no run goes on unwatched while another worker takes its trial over."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SubprocessTrial:
    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    def poll(self) -> int | None:
        return self.popen.poll()

    def stop(self) -> int:
        if self.popen.poll() is None:
            # dptrain train stops its launcher's workers on SIGTERM before it exits.
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything of its session that is still there (its own session: start_new_session)
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.popen.wait()


def trial_rdzv_id(run_dir: Path) -> str:
    """The rendezvous id of one start of a trial's run: the study's and the trial's names and a
    random part. Trials running at once on a shared etcd cluster (--rdzv-backend etcd), and a
    trial and the one that takes it over from a dead worker, must not meet in one rendezvous."""
    return f"tune-{run_dir.parent.name}-{run_dir.name}-{uuid.uuid4().hex[:8]}"


class SubprocessRunner:
    """Runs `python -m dptrain train` with this interpreter, under a rendezvous id of its own
    (`trial_rdzv_id`); its output goes to train.log in the run directory."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env

    def start(self, run_dir: Path, config: Path) -> SubprocessTrial:
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "dptrain", "train", "--config", str(config),
                "--out", str(run_dir), "--no-progress", "--rdzv-id", trial_rdzv_id(run_dir)]
        with open(run_dir / "train.log", "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent,
                                     env={**os.environ, **(self.env or {})})
        return SubprocessTrial(popen)
