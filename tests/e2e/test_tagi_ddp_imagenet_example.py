"""examples/tagi_ddp_imagenet.py (pytagi's DDP ImageNet example, ported: an image folder read
by DataLoader workers, random resized crops, pytagi's ImageNet ResNet18 stem) under dptrain
run, torchrun and mpirun: the crops are drawn from (seed, epoch, image) and sum mode with
synchronised BatchNorm is deterministic, so every launcher ends with the same fingerprint."""

from __future__ import annotations

import pytest

from tests._cli import REPO, outcome_under_every_launcher

pytestmark = pytest.mark.e2e
EXAMPLE = str(REPO / "examples" / "tagi_ddp_imagenet.py")


def test_same_fingerprint_under_every_launcher():
    outcomes = outcome_under_every_launcher(EXAMPLE, "--tiny", "--sum")
    assert len(set(outcomes.values())) == 1, outcomes
