"""Slurm for real: a one-node cluster (munged, slurmctld, slurmd; tests/_slurm.py) and srun.

srun gives no rendezvous address: the ranks take the first host of the job's node list and a
port derived from the job id, as on a real cluster.
"""

from __future__ import annotations

import json

import pytest

from tests._cli import PYTHON, REPO, base_env, run
from tests._slurm import slurm  # noqa: F401 - fixture
from tests.e2e.test_tagi_ddp_example import _outcome

pytestmark = pytest.mark.e2e


def _env(cluster) -> dict[str, str]:
    env = cluster.env(base_env())
    env.pop("GLOO_SOCKET_IFNAME", None)  # chosen by dptrain from the master's address
    return env


def test_srun_two_tasks_run_the_tagi_example(slurm):  # noqa: F811
    result = run(slurm.srun(2, PYTHON, str(REPO / "examples" / "tagi_ddp_digits.py"), "--tiny"),
                 env=_env(slurm), timeout_s=180)
    assert result.returncode == 0, result.output + slurm.logs()
    _outcome(result.stdout)  # a test error and identical replicas on 2 ranks


def test_srun_two_tasks_run_the_torch_ddp_example(slurm):  # noqa: F811
    result = run(slurm.srun(2, PYTHON, str(REPO / "examples" / "torch_toy_mlp.py"), "--tiny",
                            "--accumulation-steps", "2"), env=_env(slurm), timeout_s=180)
    assert result.returncode == 0, result.output + slurm.logs()
    assert "2 rank(s), ddp" in result.stdout, result.output
    assert result.stdout.count("identical on all 2 rank(s)") == 1, result.output


def test_dptrain_train_under_srun(slurm, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    result = run(slurm.srun(2, PYTHON, "-m", "dptrain", "train", "--epochs", "1", "--hidden",
                            "32", "--no-progress", "--out", str(out)),
                 env=_env(slurm), timeout_s=180)
    assert result.returncode == 0, result.output + slurm.logs()
    assert "2 process(es) (slurm, gloo)" in result.stdout, result.output
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
