"""What the benchmarks record about the machine they ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(env_vars: tuple[str, ...] = ()) -> str:
    """How this benchmark was started, as a user would type it from the repository root:
    `python` for the interpreter and the script path relative to the repository (no paths of
    the machine that ran it), preceded by the given environment variables that are set."""
    import os
    import shlex
    import sys

    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).resolve().parents[2])  # the repository
    except ValueError:
        script = Path(script.name)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in env_vars if k in os.environ]
    return " ".join([*env, "python", shlex.join([str(script), *sys.argv[1:]])])
