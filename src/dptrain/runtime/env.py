"""Who am I in the job: rank, sizes and rendezvous address, from whichever launcher started us.

One detector per launcher, each a pure function of an environment mapping so tests can pass a
dict. Precedence: torchrun (its agent sets `TORCHELASTIC_RUN_ID`) > hand-set `RANK`/`WORLD_SIZE`
> OpenMPI > MPICH/Intel MPI (PMI) > Slurm > single process. torchrun and MPI are often started
*inside* a Slurm allocation, so Slurm's variables describe an outer layer and are not compared with
theirs; the process-level schemes (hand-set `RANK`, OpenMPI, PMI) must agree when several are set.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from dptrain.errors import ConfigError

Launcher = Literal["torchrun", "env", "openmpi", "mpich", "slurm", "single"]

# Ports derived from a job id land here: above the well-known range and below Linux's default
# ephemeral range (32768-60999), so the OS rarely hands them out to other sockets.
DERIVED_PORT_BASE = 12000
DERIVED_PORT_SPAN = 20000


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """This process's place in the job, resolved once and passed down."""

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    local_rank: int
    """Rank among the processes on this node; selects the device."""
    local_world_size: int
    node_rank: int
    master_addr: str
    """Host of rank 0's rendezvous store ("" when world_size == 1)."""
    master_port: int
    """Port of the rendezvous store (0 when world_size == 1)."""
    launcher: Launcher
    """What started this process; `env` means RANK/WORLD_SIZE set by hand."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def __post_init__(self) -> None:
        _check_rank("rank", self.rank, "world size", self.world_size, self.launcher)
        _check_rank("local rank", self.local_rank, "local world size", self.local_world_size,
                    self.launcher)


def _check_rank(rank_name: str, rank: int, size_name: str, size: int, launcher: str) -> None:
    if size < 1:
        raise ConfigError(f"{launcher}: {size_name} must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ConfigError(f"{launcher}: {rank_name} must be in [0, {size}), got {rank}")


SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                 master_addr="", master_port=0, launcher="single")


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _opt_int(environ: Mapping[str, str], name: str, default: int) -> int:
    return _int(environ, name) if name in environ else default


def _require_pair(environ: Mapping[str, str], a: str, b: str, launcher: str) -> bool:
    """True when both are set, False when neither; an error naming them when only one is."""
    has_a, has_b = a in environ, b in environ
    if has_a != has_b:
        present, missing = (a, b) if has_a else (b, a)
        raise ConfigError(f"{launcher} environment is partial: {present} is set but {missing} is "
                          f"not; set both or neither")
    return has_a


def _torchrun(environ: Mapping[str, str]) -> dict | None:
    if not _require_pair(environ, "RANK", "WORLD_SIZE", "torchrun/env"):
        if "TORCHELASTIC_RUN_ID" in environ:
            raise ConfigError("TORCHELASTIC_RUN_ID is set but RANK and WORLD_SIZE are not: "
                              "this process was not started as a torchrun worker")
        return None
    rank, world_size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank = _opt_int(environ, "LOCAL_RANK", rank)
    local_world_size = _opt_int(environ, "LOCAL_WORLD_SIZE", world_size)
    return dict(rank=rank, world_size=world_size, local_rank=local_rank,
                local_world_size=local_world_size,
                node_rank=_opt_int(environ, "GROUP_RANK", rank // max(local_world_size, 1)),
                launcher="torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env")


def _openmpi(environ: Mapping[str, str]) -> dict | None:
    if not _require_pair(environ, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OpenMPI"):
        return None
    world_size = _int(environ, "OMPI_COMM_WORLD_SIZE")
    local_world_size = _opt_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
    rank = _int(environ, "OMPI_COMM_WORLD_RANK")
    return dict(rank=rank, world_size=world_size,
                local_rank=_opt_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                local_world_size=local_world_size,
                node_rank=rank // local_world_size, launcher="openmpi")


def _mpich(environ: Mapping[str, str]) -> dict | None:
    if not _require_pair(environ, "PMI_RANK", "PMI_SIZE", "MPICH/PMI"):
        return None
    world_size = _int(environ, "PMI_SIZE")
    local_world_size = _opt_int(environ, "MPI_LOCALNRANKS", world_size)
    rank = _int(environ, "PMI_RANK")
    return dict(rank=rank, world_size=world_size,
                local_rank=_opt_int(environ, "MPI_LOCALRANKID", rank % local_world_size),
                local_world_size=local_world_size,
                node_rank=rank // local_world_size, launcher="mpich")


def _slurm(environ: Mapping[str, str]) -> dict | None:
    if "SLURM_PROCID" not in environ:
        return None
    # srun sets the step's own task count; SLURM_NTASKS is the allocation's.
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    if size_var not in environ:
        raise ConfigError("Slurm environment is partial: SLURM_PROCID is set but neither "
                          "SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")
    world_size = _int(environ, size_var)
    rank = _int(environ, "SLURM_PROCID")
    local_world_size = _slurm_tasks_on_this_node(environ, world_size)
    return dict(rank=rank, world_size=world_size,
                local_rank=_opt_int(environ, "SLURM_LOCALID", 0),
                local_world_size=local_world_size,
                node_rank=_opt_int(environ, "SLURM_NODEID", rank // local_world_size),
                launcher="slurm")


def _slurm_tasks_on_this_node(environ: Mapping[str, str], world_size: int) -> int:
    """Tasks on this node, from SLURM_TASKS_PER_NODE's `2(x3),1` syntax."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return world_size
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _opt_int(environ, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else counts[-1]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: `gpu[01-03,07],cpu1` -> gpu01 gpu02 gpu03 gpu07 cpu1.

    Zero padding of the range bounds is kept, as Slurm does.
    """
    hosts: list[str] = []
    for token in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        expanded = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", token):
            choices = [literal]
            if bracket:
                choices = [literal + item for item in _expand_ranges(bracket, hostlist)]
            expanded = [head + tail for head in expanded for tail in choices]
        hosts += [h for h in expanded if h]
    if not hosts:
        raise ConfigError(f"empty Slurm node list {hostlist!r}")
    return hosts


def _expand_ranges(bracket: str, hostlist: str) -> list[str]:
    items: list[str] = []
    for part in bracket.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"cannot parse Slurm node list {hostlist!r} at {part!r}")
        if not sep:
            items.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigError(f"descending range {part!r} in Slurm node list {hostlist!r}")
        items += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return items


def derived_port(job_id: str) -> int:
    """A port every rank of one job computes alike, from a job identifier."""
    return DERIVED_PORT_BASE + zlib.crc32(job_id.encode()) % DERIVED_PORT_SPAN


_HINT_MASTER = ("HINT: pass the rendezvous address of rank 0's host and a free port, for example "
                "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29400 ...`, or "
                "`export MASTER_ADDR=... MASTER_PORT=...` before srun; or install mpi4py, which "
                "dptrain then uses to agree on them")


def _rendezvous(environ: Mapping[str, str], found: dict, parent_pid: int | None) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT when set; else what the launcher lets every rank agree on."""
    if found["world_size"] == 1:
        return environ.get("MASTER_ADDR", ""), _opt_int(environ, "MASTER_PORT", 0)
    has_both = _require_pair(environ, "MASTER_ADDR", "MASTER_PORT", found["launcher"])
    if has_both:
        return environ["MASTER_ADDR"], _int(environ, "MASTER_PORT")
    launcher = found["launcher"]
    single_node = found["local_world_size"] == found["world_size"]
    if launcher == "slurm" and "SLURM_JOB_ID" in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
            or environ.get("SLURM_NODELIST")
        if nodelist:
            return expand_hostlist(nodelist)[0], derived_port(environ["SLURM_JOB_ID"])
    if launcher == "openmpi" and single_node:
        job = environ.get("OMPI_MCA_ess_base_jobid") or environ.get("PMIX_NAMESPACE")
        if job:
            return "127.0.0.1", derived_port("ompi" + job)
    if launcher == "mpich" and single_node and parent_pid is not None:
        # Hydra starts the ranks of one node from a single proxy process: its pid is shared.
        job = environ.get("PMI_KVSNAME") or f"ppid{parent_pid}"
        return "127.0.0.1", derived_port("pmi" + job)
    if launcher in ("openmpi", "mpich") and (agreed := _agree_with_mpi4py()):
        return agreed
    raise ConfigError(f"{launcher}: world size {found['world_size']} but MASTER_ADDR and "
                      f"MASTER_PORT are not set and cannot be derived.\n{_HINT_MASTER}")


def _agree_with_mpi4py() -> tuple[str, int] | None:
    """Rank 0 names its host and a free port and MPI broadcasts them; None without mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    import socket

    choice = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            choice = (socket.getfqdn(), s.getsockname()[1])
    return MPI.COMM_WORLD.bcast(choice, root=0)


_DETECTORS: tuple[tuple[str, Callable[[Mapping[str, str]], dict | None]], ...] = (
    ("RANK/WORLD_SIZE", _torchrun),
    ("OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE", _openmpi),
    ("PMI_RANK/PMI_SIZE", _mpich),
)


def _process_level(environ: Mapping[str, str]) -> dict | None:
    """The first process-level scheme found, after checking that the others set agree with it."""
    found = [(names, info) for names, detect in _DETECTORS if (info := detect(environ))]
    if not found:
        return None
    names, first = found[0]
    if first["launcher"] == "torchrun":
        return first  # torchrun's agent may itself run under mpirun: its workers' values win
    for other_names, other in found[1:]:
        if (other["rank"], other["world_size"]) != (first["rank"], first["world_size"]):
            raise ConfigError(
                f"launchers disagree: {names} say rank {first['rank']} of {first['world_size']} "
                f"but {other_names} say rank {other['rank']} of {other['world_size']}; "
                f"unset the stale variables")
    return first


def resolve_env(environ: Mapping[str, str] | None = None, *,
                parent_pid: int | None = None) -> DistEnv:
    """Resolve this process's `DistEnv` from the environment (default `os.environ`).

    Raises `ConfigError` naming the variables when the environment is partial, inconsistent, or a
    multi-process job gives no way to agree on a rendezvous address.
    """
    if environ is None:
        environ = os.environ
        parent_pid = os.getppid() if parent_pid is None else parent_pid
    found = _process_level(environ) or _slurm(environ)
    if found is None:
        return SINGLE
    addr, port = _rendezvous(environ, found, parent_pid)
    return DistEnv(master_addr=addr, master_port=port, **found)
