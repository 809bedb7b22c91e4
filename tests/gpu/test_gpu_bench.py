"""bench/gpu.py, which only a machine with a GPU runs for real: its refusal without CUDA, and its
steps and measurement on every device here (so that the script a person runs on a GPU has
at least run, on small batches, wherever the tests do)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests._cli import REPO, base_env

pytestmark = pytest.mark.gpu

SCRIPT = REPO / "bench" / "gpu.py"


def _bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_refuses_in_one_line(tmp_path):
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--output", str(out)],
                            env=base_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no CUDA device" in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("network, batch", [("cnn", 4), ("resnet18", 2)])
def test_each_measured_step_runs_on_the_device(network, batch, device):
    bench = _bench_gpu()
    for kind in ("tagi", "torch"):
        result = bench.measure(kind, network, batch, 1, device)
        assert result["seconds_per_step"] > 0
        assert (result["peak_gpu_mb"] is None) == (device.type == "cpu")
    assert round(bench.PYTAGI_PUBLISHED["samples_per_s"], 1) == 350.6  # 50,000 / 142.6
