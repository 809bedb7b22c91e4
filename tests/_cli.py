"""Run real commands (dptrain run, torchrun, mpirun) with a deadline that kills what they started.

torchrun's workers live in their own sessions, so killing the launcher's process group misses
them; SIGTERM to the launcher first lets it stop its workers (measured: well under a second),
and SIGKILL to the whole session follows only after a grace period.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def dptrain_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "dptrain", *args]


def mpirun_cmd(nproc: int, *args: str) -> list[str]:
    mpirun = shutil.which("mpirun.openmpi") or shutil.which("mpirun")
    assert mpirun, "mpirun not found: `make test` installs OpenMPI (openmpi-bin)"
    flags = ["--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return [mpirun, "-np", str(nproc), *flags, *args]


def mpich_cmd(nproc: int, *args: str) -> list[str]:
    mpiexec = shutil.which("mpiexec.mpich")
    assert mpiexec, "mpiexec.mpich not found: `make test` installs MPICH (mpich)"
    return [mpiexec, "-n", str(nproc), *args]


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI",
                                "SLURM_", "TORCHELASTIC_", "DPTRAIN_ATTEMPT",
                                "DPTRAIN_RUN_LABEL"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", **extra)
    return env


def stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM the launcher, then SIGKILL its whole session after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=5)


def run(cmd: list[str], *, timeout_s: float = 120, env: dict[str, str] | None = None,
        cwd: Path | str = REPO) -> Completed:
    """Run `cmd` to completion, or stop it and raise `TimeoutError` with its output so far."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} still running after {timeout_s}s\n{out}\n{err}")
    except BaseException:  # pytest-timeout's or Ctrl-C's exception: never leave the job running
        stop(proc)
        proc.stdout.close()
        proc.stderr.close()
        raise
    return Completed(proc.returncode, out, err)


def outcome_under_every_launcher(*args: str, mode: str = "sum") -> dict[str, tuple[str, str]]:
    """(test error, parameter fingerprint) a TAGI example script prints on 2 processes under
    `dptrain run`, torchrun and mpirun, by launcher (the example's own output lines)."""
    outcomes = {}
    for name, cmd in {
        "dptrain run": dptrain_cmd("run", "-n", "2", *args),
        "torchrun": [PYTHON, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node=2", *args],
        "mpirun": mpirun_cmd(2, PYTHON, *args),
    }.items():
        result = run(cmd, timeout_s=120)
        assert result.returncode == 0, (name, result.output)
        error = re.search(rf"test error ([\d.]+) % \(2 rank\(s\), {mode} mode\)", result.stdout)
        fingerprint = re.search(r"replicas identical on 2 rank\(s\); fingerprint (\w+)",
                                result.stdout)
        assert error and fingerprint, (name, result.output)
        outcomes[name] = (error.group(1), fingerprint.group(1))
    return outcomes
