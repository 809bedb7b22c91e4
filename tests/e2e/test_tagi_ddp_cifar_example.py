"""examples/tagi_ddp_cifar_resnet.py (TAGI ResNet18 with BatchNorm, augmentation and a σ_v
schedule) under dptrain run, torchrun and mpirun: sum mode with synchronised BatchNorm
statistics is deterministic, so every launcher must end with the same parameter fingerprint."""

from __future__ import annotations

import re

import pytest

from tests._cli import PYTHON, REPO, dptrain_cmd, mpirun_cmd, run

pytestmark = pytest.mark.e2e
EXAMPLE = str(REPO / "examples" / "tagi_ddp_cifar_resnet.py")


def test_same_fingerprint_under_every_launcher():
    outcomes = {}
    args = [EXAMPLE, "--tiny", "--sigma-v-decay", "0.5"]
    for name, cmd in {
        "dptrain run": dptrain_cmd("run", "-n", "2", *args),
        "torchrun": [PYTHON, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node=2", *args],
        "mpirun": mpirun_cmd(2, PYTHON, *args),
    }.items():
        result = run(cmd, timeout_s=120)
        assert result.returncode == 0, (name, result.output)
        error = re.search(r"test error ([\d.]+) % \(2 rank\(s\), sum mode\)", result.stdout)
        fingerprint = re.search(r"replicas identical on 2 rank\(s\); fingerprint (\w+)",
                                result.stdout)
        assert error and fingerprint, (name, result.output)
        outcomes[name] = (error.group(1), fingerprint.group(1))
    assert len(set(outcomes.values())) == 1, outcomes
