"""The native library across processes: four building into one empty cache at once each load a
whole library, and two ranks of one job with libraries built for different instruction sets
(-march=native, with fused multiply-adds where the CPU has them, and plain x86-64) keep
bit-identical replicas (native.py: the capped step rounds alike on every CPU)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.runtime import DDPConfig
from dptrain.tagi import LSTM, Linear, ReLU, Sequential, manual_seed
from dptrain.tagi.ddp import DDPSequential
from tests._world import run_world

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64

BUILDER = """
import sys, time
from pathlib import Path
import torch
from dptrain.tagi import native
go = Path(sys.argv[1])
while not go.exists():  # all four start building together
    time.sleep(0.01)
lib = native.library()
print("BUILT", lib._name, native.blas(torch.float64) >= 0)
"""

#: a rank that starts late: it loads the library the moment its name is in the cache, as
#: native.py does when it finds it there (a file written in place would be caught half done)
WATCHER = """
import ctypes, sys, time
from pathlib import Path
cache = Path(sys.argv[1])
deadline = time.monotonic() + 200
while time.monotonic() < deadline:
    found = sorted(cache.glob("tagi_step-*.so")) if cache.is_dir() else []
    if found:
        print("LOADED", found[0], bool(ctypes.CDLL(str(found[0])).capped_step_f64))
        break
    time.sleep(0.001)
"""


def test_four_processes_building_into_one_empty_cache_each_load_a_whole_library(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "DPTRAIN_NATIVE_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    builders = [subprocess.Popen([sys.executable, "-c", BUILDER, str(go)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(4)]
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(cache)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    builders.append(watcher)
    try:
        time.sleep(1.0)  # (each waits for `go` once torch is imported)
        go.touch()
        outputs = [b.communicate(timeout=240) for b in builders]
    finally:
        for b in builders:
            if b.poll() is None:
                b.kill()
                b.wait()
    [library] = list(cache.iterdir())  # one library, no temporary file or folder left
    assert f"LOADED {library} True" in outputs[-1][0], outputs[-1]
    for b, (out, err) in zip(builders[:-1], outputs):
        assert b.returncode == 0, err
        # each loaded the published file (a partial one would not load, or lack symbols)
        assert f"BUILT {library} True" in out, (out, err)


def _net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(LSTM(2, 4, 3), Linear(12, 8), ReLU(), Linear(8, 1), dtype=F64)


def _two_instruction_sets(rank: int, world_size: int, caches: list[str], steps: int) -> dict:
    # each rank its own build: set before the library is first loaded in this process
    os.environ["DPTRAIN_NATIVE_CACHE"] = caches[rank]
    if rank == 1:
        os.environ["DPTRAIN_NATIVE_FLAGS"] = "-march=x86-64 -mtune=generic"
    from dptrain.tagi import native
    config = DDPConfig(device_ids=[], backend="gloo", rank=rank, world_size=world_size)
    ddp = DDPSequential(_net(seed=rank), config)
    step = ddp.compile(native=True)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
    for k in range(steps):
        x = torch.randn(4, 3, 2, generator=g, dtype=F64)
        step(x, torch.sin(x.sum(dim=(1, 2))).unsqueeze(1), 0.05 + 0.001 * k)
    ddp.check_replicas()
    return dict(library=native.library()._name, native=bool(step._natives),
                fallback=step.fallback_reason, compiled=step.compiled_steps,
                params=ddp.model.flat_params.clone())


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-march=x86-64 is an x86-64 flag")
def test_ranks_with_libraries_for_different_instruction_sets_keep_identical_replicas(tmp_path):
    caches = [str(tmp_path / "native"), str(tmp_path / "x86-64")]
    steps = 50
    results = run_world(_two_instruction_sets, caches, steps, world_size=2, timeout_s=240)
    libraries = [Path(r["library"]) for r in results]
    assert [str(p.parent) for p in libraries] == caches  # two builds, one per rank
    assert libraries[0].read_bytes() != libraries[1].read_bytes()
    for r in results:
        assert r["native"] and r["fallback"] is None and r["compiled"] == steps
    assert torch.equal(results[0]["params"], results[1]["params"])  # bit for bit
