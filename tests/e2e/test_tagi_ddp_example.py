"""examples/tagi_ddp_digits.py under every launcher: torchrun (via dptrain run and directly),
OpenMPI's mpirun, and two processes given Slurm's variables by hand. Sum-mode TAGI is
deterministic, so every launcher must print the same test error and parameter fingerprint."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests._cli import PYTHON, REPO, base_env, dptrain_cmd, mpirun_cmd, run, stop

pytestmark = pytest.mark.e2e
EXAMPLE = str(REPO / "examples" / "tagi_ddp_digits.py")
RESULT = re.compile(r"test error ([\d.]+) % \(2 rank\(s\), sum mode\)")


def _outcome(text: str) -> tuple[str, str]:
    error = RESULT.search(text)
    fingerprint = re.search(r"replicas identical on 2 rank\(s\); fingerprint (\w+)", text)
    assert error and fingerprint, text
    return error.group(1), fingerprint.group(1)


def _slurm_pair(timeout_s: float = 120) -> str:
    """Two processes with SLURM_* set as srun would (no MASTER_*: derived from the job id)."""
    procs = []
    for rank in (0, 1):
        env = base_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                       SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_JOB_ID=str(os.getpid()),
                       SLURM_JOB_NODELIST="localhost")
        procs.append(subprocess.Popen([PYTHON, EXAMPLE, "--tiny"], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            stop(p, grace_s=2)
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs[0]


def test_same_result_under_every_launcher():
    outcomes = {}
    for name, cmd in {
        "dptrain run": dptrain_cmd("run", "-n", "2", EXAMPLE, "--tiny"),
        "torchrun": [PYTHON, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node=2", EXAMPLE, "--tiny"],
        "mpirun": mpirun_cmd(2, PYTHON, EXAMPLE, "--tiny"),
    }.items():
        result = run(cmd, timeout_s=120)
        assert result.returncode == 0, (name, result.output)
        outcomes[name] = _outcome(result.stdout)
    outcomes["slurm env"] = _outcome(_slurm_pair())
    assert len(set(outcomes.values())) == 1, outcomes
