"""examples/tagi_ddp_cifar_resnet.py (TAGI ResNet18 with BatchNorm, augmentation and a σ_v
schedule) under dptrain run, torchrun and mpirun: sum mode with synchronised BatchNorm
statistics is deterministic, so every launcher must end with the same parameter fingerprint."""

from __future__ import annotations

import pytest

from tests._cli import REPO, outcome_under_every_launcher

pytestmark = pytest.mark.e2e
EXAMPLE = str(REPO / "examples" / "tagi_ddp_cifar_resnet.py")


def test_same_fingerprint_under_every_launcher():
    outcomes = outcome_under_every_launcher(EXAMPLE, "--tiny", "--sigma-v-decay", "0.5")
    assert len(set(outcomes.values())) == 1, outcomes
