"""`make demo` once, recorded: what the README's "The two commands" section shows.

    .venv/bin/python bench/demo.py      # ~15 s; writes bench/results/demo.json

Runs `dptrain train` with its defaults (TAGI MLP, digits, 2 processes, 10 epochs) in a fresh
temporary directory and records the command's wall time (start-up included), the last lines
it printed and the run's summary.json. The metrics are deterministic on a given machine (the
e2e test tests/e2e/test_train_cli.py checks the README's lines against a fresh run); samples/s
and the times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for `common`
from common import RESULTS, command_line, cpu_model, git_describe, write_json  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "demo.json"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "dptrain", "train", "--no-progress"],
                             cwd=tmp, capture_output=True, text=True, timeout=600, check=True)
        wall = time.perf_counter() - start
        summary = json.loads(next(Path(tmp, "runs").glob("*/summary.json")).read_text())
    lines = out.stdout.strip().splitlines()
    print("\n".join(lines[-3:]))
    print(f"command wall time {wall:.1f} s")
    summary.pop("config", None)  # the options are the defaults; the paths are this machine's
    summary.pop("run_dir", None)
    write_json(args.output, {"command": command_line(), "dptrain_command": "dptrain train",
                             "command_wall_s": wall, "last_lines": lines[-3:],
                             "load_average_1_5_15": {"before": load_before,
                                                     "after": os.getloadavg()},
                             "summary": summary, "cpu": cpu_model(), "git": git_describe()})


if __name__ == "__main__":
    main()
