"""What the benchmarks share: the one module a bench script imports from besides dptrain, torch
and the standard library (no benchmark imports another, and no bench file depends on tests/).

A script in a topic folder (bench/<topic>/<script>.py) finds this package with one line before
its imports from it, so that it runs from the repository root as
`.venv/bin/python bench/<topic>/<script>.py`:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
    from common import RESULTS, command_line, write_json  # noqa: E402

(bench/demo.py and bench/gpu.py, in bench/ itself, have it on sys.path already.)

- this module: the folders, the record every result file carries (`hardware`, `git_describe`,
  `command_line`, `cpu_model`), `write_json`, and the pytagi wheel's venv (`setup_pytagi_venv`);
- `common.machine`: `cpu_model` and `command_line`;
- `common.digit_files`: scikit-learn's digits as MNIST IDX / CIFAR-10 files;
- `common.image_folder`: generated image folders for the input-pipeline benchmarks;
- `common.gaussian_forecasts`: scores of Gaussian predictions, for the regressions vs pytagi;
- `common.lstm_example`: pytagi's LSTM forecasting example, run by either library;
- `common.gpt_runs`: the Shakespeare text and one `dptrain train` run of a GPT on it;
- `common.netns`: hosts made of network namespaces (needs root), for node_loss.py;
- `common.pytagi_port`: the import rewrite a pytagi user makes, over a tree of programs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from .machine import command_line, cpu_model

__all__ = ["BENCH_DIR", "REPO", "RESULTS", "PYTAGI_DIR", "PYTAGI_VENV", "command_line",
           "cpu_model", "display_path", "git_describe", "hardware", "setup_pytagi_venv",
           "write_json"]

BENCH_DIR = Path(__file__).resolve().parents[1]
"""bench/"""
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
"""bench/results/: every benchmark's JSON record, whatever its topic folder."""
PYTAGI_DIR = BENCH_DIR / "pytagi"
"""setup_pytagi.sh and the workers that run in the wheel's venv."""
PYTAGI_VENV = BENCH_DIR / ".venv-pytagi"
"""The pytagi 0.2.1 wheel's own venv (git-ignored), made by pytagi/setup_pytagi.sh."""


def setup_pytagi_venv() -> Path:
    """Run setup_pytagi.sh (idempotent) and return the venv's python."""
    subprocess.run(["bash", str(PYTAGI_DIR / "setup_pytagi.sh")], check=True)
    return PYTAGI_VENV / "bin" / "python"


def hardware() -> dict:
    info = {"cpu_model": platform.processor() or "unknown", "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
            "os": platform.system()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines()
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu_model"] = fields["model name"]
        info["cpu_family_model"] = f"{fields.get('cpu family')}/{fields.get('model')}"
        flags = fields.get("flags", "").split()
        info["simd"] = [f for f in ("avx2", "fma", "avx512f") if f in flags]
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["memory_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass  # not Linux: keep what platform knows
    return info


def git_describe() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=BENCH_DIR,
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def display_path(path: Path) -> str:
    """Relative to the repository when inside it: results carry no machine-specific paths."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")  # rename, so a killed run never leaves half a file
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
