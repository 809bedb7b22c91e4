"""examples/tagi_ddp_imagenet.py (pytagi's DDP ImageNet example, ported: an image folder read
by DataLoader workers, random resized crops, pytagi's ImageNet ResNet18 stem) under dptrain
run, torchrun and mpirun: the crops are drawn from (seed, epoch, image) and sum mode with
synchronised BatchNorm is deterministic, so every launcher ends with the same fingerprint."""

from __future__ import annotations

import re

import pytest

from tests._cli import PYTHON, REPO, dptrain_cmd, mpirun_cmd, run

pytestmark = pytest.mark.e2e
EXAMPLE = str(REPO / "examples" / "tagi_ddp_imagenet.py")


def test_same_fingerprint_under_every_launcher():
    outcomes = {}
    args = [EXAMPLE, "--tiny", "--sum"]
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
