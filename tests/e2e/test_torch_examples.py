"""The torch examples, unchanged, under `dptrain run -n 2` (torchrun's agent) with tiny sizes."""

from __future__ import annotations

import pytest

from tests._cli import REPO, dptrain_cmd, run

pytestmark = pytest.mark.e2e
EXAMPLES = REPO / "examples"


def _run_example(name: str, *flags: str):
    result = run(dptrain_cmd("run", "-n", "2", str(EXAMPLES / name), "--tiny", *flags),
                 timeout_s=150)
    assert result.returncode == 0, result.output
    assert "Warning" not in result.stderr, result.stderr
    return result


def test_toy_mlp_example_trains_with_identical_replicas():
    """DDP with accumulation: the example itself exits non-zero if replicas differ."""
    result = _run_example("torch_toy_mlp.py", "--accumulation-steps", "2")
    assert "2 rank(s), ddp" in result.stdout
    assert "epoch 1: train loss" in result.stdout
    assert result.stdout.count("identical on all 2 rank(s)") == 1, "rank 0 reports, once"


def test_cnn_digits_example_with_fsdp_bf16_and_global_batchnorm():
    """FSDP2 + bf16 + global-batch BatchNorm under the real launcher; every test image is
    evaluated exactly once over both ranks (docs/design.md, contract 5)."""
    result = _run_example("torch_cnn_digits.py", "--strategy", "fsdp", "--precision", "bf16")
    assert "2 rank(s), fsdp, 256 training images" in result.stdout
    assert "on 360 images" in result.stdout, result.output
