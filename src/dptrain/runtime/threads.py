"""How many intra-op threads each rank gets, and when OpenMP must not spin.

The rule (docs/design.md, Threads per rank):

- A rank may run on the CPUs of its affinity mask, capped by the CPU quota of its cgroup
  (rounded up to whole cores). That is its usable cores; the machine's core count is not.
- The local ranks share those cores unless the launcher bound each rank to cores of its own.
  Binding shows as an affinity mask narrower than the parent process's (the launcher's:
  mpirun, hydra_pmi_proxy, slurmstepd); dptrain run's agent binds nothing, so its workers
  inherit its mask. A rank whose mask is narrower assumes the local ranks were spread evenly
  over the parent's CPUs, so ceil(local ranks x its CPUs / parent's CPUs) of them share its mask
  (1 for one core per rank, 2 for four ranks bound to the two sockets of a machine).
- A CPU quota belongs to the cgroup, which holds every local rank: each gets quota / local ranks.
- threads = max(1, min(usable CPUs / ranks sharing them, quota / local ranks)).

Errors lean towards fewer threads: an unreadable parent counts as unbound (the set is divided).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadShare:
    """Intra-op threads for one rank, and the facts they come from."""

    threads: int
    cpus: int
    """CPUs in this process's affinity mask."""
    quota: int | None
    """Whole cores of the cgroup CPU quota (rounded up), None without a quota."""
    sharing: int
    """Local ranks assumed to share this process's CPUs."""
    local_ranks: int
    bound: bool
    """The launcher bound this rank to a narrower CPU set than its own."""

    @property
    def usable(self) -> int:
        """Cores this process may use: its CPUs, capped by the quota."""
        return min(self.cpus, self.quota) if self.quota else self.cpus

    def reason(self) -> str:
        """Why `threads`, in words (`dptrain env`, logs)."""
        quota = f", cgroup quota {self.quota} core(s)" if self.quota else ""
        if self.bound:
            share = (f"the launcher bound this rank to {self.cpus} CPU(s){quota}, shared by "
                     f"{self.sharing} of {self.local_ranks} local rank(s)")
        else:
            share = (f"{self.cpus} usable CPU(s){quota} shared by {self.local_ranks} local "
                     f"rank(s)")
        return share


def cgroup_quota(proc_cgroup: Path = Path("/proc/self/cgroup"),
                 root: Path = CGROUP_ROOT) -> int | None:
    """Whole cores of the tightest CPU quota on this process's cgroup or its ancestors, rounded
    up (a quota of 1.5 cores lets two threads run most of the time), None without one.

    cgroup v2: `cpu.max` ("QUOTA PERIOD" or "max PERIOD"); v1: `cpu.cfs_quota_us` (-1: none)
    and `cpu.cfs_period_us` under the cpu controller's mount.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: float | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            candidates = [(root, "cpu.max", None)]
        elif "cpu" in controllers.split(","):
            candidates = [(root / name, "cpu.cfs_quota_us", "cpu.cfs_period_us")
                          for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")]
        else:
            continue
        for mount, quota_file, period_file in candidates:
            if not mount.is_dir():
                continue
            directory = mount / path.lstrip("/")
            for level in (directory, *directory.parents):
                if level == mount.parent:
                    break
                cores = _quota_at(level, quota_file, period_file)
                if cores is not None and (best is None or cores < best):
                    best = cores
            break
    return None if best is None else max(1, math.ceil(best))


def _quota_at(directory: Path, quota_file: str, period_file: str | None) -> float | None:
    try:
        if period_file is None:
            quota, period = (directory / quota_file).read_text().split()
        else:
            quota = (directory / quota_file).read_text().strip()
            period = (directory / period_file).read_text().strip()
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def affinity(pid: int = 0) -> frozenset[int] | None:
    """The CPUs `pid` may run on (0: this process), None when it cannot be read."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS), or no such process
        return None


def share_threads(local_ranks: int, cpus: frozenset[int] | set[int],
                  parent_cpus: frozenset[int] | set[int] | None,
                  quota: int | None) -> ThreadShare:
    """The rule of this module's docstring, on given facts (pure: tests pass sets)."""
    local_ranks = max(1, local_ranks)
    mine = max(1, len(cpus))
    bound = parent_cpus is not None and set(cpus) < set(parent_cpus)
    if bound:
        sharing = min(local_ranks, max(1, math.ceil(local_ranks * mine / len(parent_cpus))))
    else:
        sharing = local_ranks
    threads = mine // sharing
    if quota:
        threads = min(threads, quota // local_ranks)
    return ThreadShare(max(1, threads), mine, quota, sharing, local_ranks, bound)


def this_process_share(local_ranks: int, *, launcher_side: bool = False) -> ThreadShare:
    """The share of a rank that is this process (`launcher_side`: of each of the `local_ranks`
    workers this process is about to start without binding them, which inherit its mask)."""
    cpus = affinity() or frozenset(range(os.cpu_count() or 1))
    parent = None if launcher_side else affinity(os.getppid())
    return share_threads(local_ranks, cpus, parent, cgroup_quota())


def oversubscribed(ranks: int, threads: int, usable: int) -> bool:
    """`ranks` processes of `threads` threads each on `usable` cores have more threads than
    cores, so OpenMP's spin-waiting can stall them. One thread per rank never waits for a peer
    thread (no parallel region), however many ranks share the cores."""
    return threads > 1 and ranks * threads > usable


def env_threads(environ: dict[str, str] | os._Environ) -> int | None:
    """OMP_NUM_THREADS as a positive count (its first level for a nested list), else None."""
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None
