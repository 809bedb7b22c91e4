"""The native step's edges (native.py, compiled.py): a cache that cannot be written, no
compiler or one that fails, a torch without an internal the compiled step calls. Each falls
back, to a build elsewhere or to the eager loop, with one log line."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dptrain import tagi

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """native.py as a process starts it, its temporary directory this test's own."""
    from dptrain.tagi import native
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return native


def _records(caplog, level=logging.INFO):
    return [r for r in caplog.records if r.name.startswith("dptrain") and r.levelno >= level]


@pytest.mark.parametrize("case", ["read-only", "cannot be made"])
def test_a_cache_that_cannot_be_written_builds_in_the_temporary_directory(
        case, fresh, tmp_path, monkeypatch, caplog):
    if case == "read-only":
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o555)
        if os.geteuid() == 0:  # root writes through file modes; /proc refuses every new file
            cache = Path("/proc")
    else:  # beneath a regular file
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "native"
    monkeypatch.setenv("DPTRAIN_NATIVE_CACHE", str(cache))
    with caplog.at_level(logging.DEBUG, logger="dptrain"):
        built = fresh._build()
    assert built.parent == tmp_path / "tmp" / f"dptrain-native-{os.getuid()}"
    assert ctypes.CDLL(str(built)).capped_step_f64  # a whole library
    [line] = _records(caplog)
    assert line.levelno == logging.WARNING and "cannot be written" in line.getMessage()
    caplog.clear()
    stamp = built.stat().st_mtime_ns
    with caplog.at_level(logging.DEBUG, logger="dptrain"):  # the next process: found there
        assert fresh._build() == built and built.stat().st_mtime_ns == stamp
    assert len(_records(caplog)) == 1  # and said again, once


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["no compiler", "fails"])
def test_without_a_working_compiler_the_step_is_eager_after_one_line(cc, fresh, tmp_path,
                                                                      monkeypatch, caplog):
    monkeypatch.setenv("DPTRAIN_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", cc)
    tagi.manual_seed(0)
    net = tagi.Sequential(tagi.Linear(3, 4), tagi.ReLU(), tagi.Linear(4, 1), dtype=F64)
    tagi.manual_seed(0)
    eager = tagi.Sequential(tagi.Linear(3, 4), tagi.ReLU(), tagi.Linear(4, 1), dtype=F64)
    step = net.compile(native=True)
    x, y = torch.randn(5, 3, dtype=F64), torch.randn(5, 1, dtype=F64)
    with caplog.at_level(logging.INFO, logger="dptrain"):
        for _ in range(2):
            step(x, y, 0.1)
    for _ in range(2):
        eager(x)
        tagi.OutputUpdater().update(eager.output_z_buffer, y, 0.1, eager.input_delta_z_buffer)
        eager.backward()
        eager.step()
    [line] = _records(caplog)
    why = "is not found" if cc.startswith("/") else "false -O3 failed"
    assert "could not be built" in line.getMessage() and why in line.getMessage()
    assert why in step.fallback_reason and step.eager_steps == 2 and not step._natives
    assert torch.equal(net.flat_params, eager.flat_params)  # the eager loop's steps


MISSING = """
import logging, sys, torch
import {module}
delattr({module}, "{name}")
logging.basicConfig(level=logging.INFO, format="LINE %(name)s %(message)s", stream=sys.stdout)
from dptrain import tagi
tagi.manual_seed(0)
net = tagi.Sequential(tagi.Linear(3, 4), tagi.ReLU(), tagi.Linear(4, 1),
                      dtype=torch.float64)
step = net.compile(native={native}, backend="aot_eager")
x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
for _ in range(3):
    step(x, y, 0.1)
print("RESULT", step.eager_steps, step.compiled_steps, bool(step._natives))
"""


@pytest.mark.parametrize("module, name, native", [
    ("torch.autograd.graph", "increment_version", None),
    ("torch._dynamo", "lookup_backend", False)])
def test_a_torch_without_an_internal_steps_eagerly_after_one_line(module, name, native):
    """A torch release without a private function the compiled step calls: simulated by
    removing it before dptrain is imported (the native step's at import, the tracer's at the
    first trace)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MISSING.format(module=module, name=name,
                                                                native=native)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("LINE dptrain")]
    assert len(lines) == 1, done.stdout
    assert f"torch {torch.__version__} lacks {module}.{name}" in lines[0]
    assert "RESULT 3 0 False" in done.stdout
