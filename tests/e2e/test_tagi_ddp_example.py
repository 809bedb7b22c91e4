"""examples/tagi_ddp_digits.py under every launcher: torchrun (via dptrain run and directly),
OpenMPI's mpirun, and two processes given Slurm's variables by hand. Sum-mode TAGI is
deterministic, so every launcher must print the same test error and parameter fingerprint. And
on one process with the same global batch it trains the same network: the epoch's last batch is
split unevenly, not padded."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests._cli import PYTHON, REPO, base_env, dptrain_cmd, mpirun_cmd, run, stop
from tests._runs import relative_gap

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


def test_one_process_on_the_global_batch_trains_the_same_network(tmp_path):
    """Sum mode, --tiny: 331 training samples, 2 ranks x 16 against 1 x 32. The last step holds
    11 samples, 6 on rank 0 and 5 on rank 1; padding it (a sample of rank 1's repeated) would
    make it another step than one process's. Same parameters up to float summation order."""
    saved = {}
    for nproc, batch in ((2, 16), (1, 32)):
        saved[nproc] = tmp_path / f"{nproc}.pt"
        cmd = dptrain_cmd("run", "-n", str(nproc), EXAMPLE, "--tiny", "--batch-size", str(batch),
                          "--save", str(saved[nproc]))
        result = run(cmd, timeout_s=120)
        assert result.returncode == 0, result.output
    two, one = (torch.load(saved[n], weights_only=True)["state_dict"] for n in (2, 1))
    assert relative_gap(two, one) <= 1e-5
