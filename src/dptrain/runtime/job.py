"""The job this process belongs to, as its launcher names it.

A restarted attempt of a job (torchrun's restarts, a requeued Slurm job) keeps its launcher's
job id, so a run directory named after it is found again. Pure functions of an environment
mapping, like `dptrain.runtime.env`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping

# The id of the launcher that started this process first (the innermost one), then Slurm's:
# torchrun or mpirun are often started inside a Slurm allocation.
_IDS: dict[str, tuple[str, ...]] = {
    "torchrun": ("TORCHELASTIC_RUN_ID",),
    "openmpi": ("OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
    "mpich": ("PMI_KVSNAME",),
}
_SLURM = ("SLURM_JOB_ID",)

ATTEMPT_ENV = "DPTRAIN_ATTEMPT"
"""Set by `dptrain run`/`train`'s agents with a static rendezvous: the job's attempt, agreed by
every node (a node's own TORCHELASTIC_RESTART_COUNT can lag behind another's)."""
RUN_LABEL_ENV = "DPTRAIN_RUN_LABEL"
"""Set by `dptrain run`/`train`'s agents: a label every node agreed on (the first agent's start
time), naming the run directory of a multi-node job without --out."""


def attempt(environ: Mapping[str, str] | None = None) -> int:
    """Which attempt of the job this process belongs to: 0, then 1 after the first restart..."""
    environ = os.environ if environ is None else environ
    for name in (ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = environ.get(name, "").strip()
        if value:
            return int(value)
    return 0
_NO_ID = {"", "none"}  # torchrun's default --rdzv-id (a static rendezvous) names no job


def job_id(launcher: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The job's id from the launcher's variables, made safe for a file name; None if none."""
    environ = os.environ if environ is None else environ
    for name in (*_IDS.get(launcher, ()), *_SLURM):
        value = environ.get(name, "").strip()
        if value.lower() not in _NO_ID:
            return re.sub(r"[^A-Za-z0-9._-]+", "-", value).strip("-.") or None
    return None


def launcher_start_time(pid: int | None = None) -> float | None:
    """When process `pid` (default: our parent) started, in seconds since the epoch; None where
    /proc cannot tell. torchrun's agent outlives the attempts it restarts, so its start time
    names the job when the rendezvous gives no id."""
    pid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def stamp(seconds: float | None = None) -> str:
    """`YYYYmmdd-HHMMSS` local time (now by default)."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(seconds))
