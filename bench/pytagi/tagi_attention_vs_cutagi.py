"""TAGI attention's training step: dptrain against cuTAGI main's CPU build, same network, batch
and threads.

    CUTAGI_BUILD=/path/to/build .venv/bin/python bench/pytagi/tagi_attention_vs_cutagi.py

cuTAGI main (commit ef69219) has no release on the package index: build it once with
`CUTAGI_BUILD=/path/to/build .venv/bin/python tests/data/make_cutagi_fixtures.py --build-only`
(see that script for its git sources; several CPU minutes). One program
(bench/pytagi/_attention_step_worker.py), written against pytagi's API, runs in a child Python with
`pytagi` from that build and in another with dptrain.pytagi: Linear(8, T·E) then
MultiheadAttention(E, H) (cuTAGI reads the Linear's (B, T·E) output as T positions of E), a
Gaussian observation of every output, backward and step. Rounds alternate sides; the figure is
the ratio of the medians (target: dptrain >= 2x cuTAGI's speed on 2 threads, as for pytagi's
other layers). Both do the same arithmetic up to cuTAGI's departures (docs/tagi.md), which
change which numbers are multiplied, not how many.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import REPO, RESULTS, command_line, cpu_model  # noqa: E402

WORKER = Path(__file__).resolve().with_name("_attention_step_worker.py")
DEFAULT_OUTPUT = RESULTS / "tagi_attention_vs_cutagi.json"
SPEED_TARGET = 2.0


def cutagi_path() -> str:
    build = os.environ.get("CUTAGI_BUILD")
    src = Path(build or "") / "cuTAGI"
    if not build or not any((src / "build").glob("cutagi*.so")):
        sys.exit("no cuTAGI build: set CUTAGI_BUILD to a folder built by "
                 "`CUTAGI_BUILD=DIR .venv/bin/python tests/data/make_cutagi_fixtures.py "
                 "--build-only`")
    return os.pathsep.join([str(src / "build"), str(src)])


def time_side(module: str, args: argparse.Namespace, cutagi: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if module == "pytagi":
        env["PYTHONPATH"] = cutagi
    cmd = [sys.executable, str(WORKER), module, str(args.threads), str(args.steps),
           str(args.t), str(args.e), str(args.heads), str(args.batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode:
        sys.exit(f"{module} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t", type=int, default=32, help="positions")
    parser.add_argument("--e", type=int, default=64, help="embedding width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    cutagi = cutagi_path()
    times: dict[str, list[float]] = {"dptrain.pytagi": [], "pytagi": []}
    for i in range(args.repeats):
        for module in (list(times) if i % 2 == 0 else list(times)[::-1]):
            times[module].append(time_side(module, args, cutagi))
            print(f"{module}: {times[module][-1] * 1e3:.2f} ms/step", flush=True)
    ours, theirs = (statistics.median(times[m]) for m in ("dptrain.pytagi", "pytagi"))
    result = {
        # the build folder is this machine's: the command names it by its role
        "benchmark": "tagi_attention_vs_cutagi",
        "command": "CUTAGI_BUILD=DIR " + command_line(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "cutagi_commit": "ef69219",
        "config": {k: getattr(args, k) for k in ("t", "e", "heads", "batch", "threads",
                                                  "steps", "repeats")},
        "step_s": {"dptrain": ours, "cutagi": theirs}, "rounds": times,
        "speedup": theirs / ours, "target_met": theirs / ours >= SPEED_TARGET,
    }
    print(f"attention step: dptrain {ours * 1e3:.2f} ms, cuTAGI main {theirs * 1e3:.2f} ms: "
          f"{result['speedup']:.2f}x (target >= {SPEED_TARGET}x)")
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
