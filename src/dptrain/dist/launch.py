"""`LaunchConfig`: how the processes of a job are started and how long they wait for each other.

None of it changes what a run computes: a run may resume with other values (docs/design.md,
contract 8), e.g. on more processes from an epoch-end checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.errors import ConfigError
from dptrain.options import bad_value, check_at_least, resumable


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Processes per node, nodes, rendezvous, threads, restarts and timeouts."""

    nproc: int = field(default=2, metadata=resumable())
    """Processes on this machine (one per device)."""
    nnodes: int = field(default=1, metadata=resumable())
    """Nodes of the job: start the same command on each, with the same rdzv-endpoint."""
    node_rank: int = field(default=-1, metadata=resumable())
    """This node's rank, 0 .. nnodes-1 (static rendezvous); -1: torch assigns it (dynamic)."""
    rdzv_endpoint: str = field(default="", metadata=resumable(metavar="HOST:PORT"))
    """Rendezvous HOST:PORT every node reaches (node 0's for a static rendezvous); needed when
    nnodes > 1."""
    rdzv_id: str = field(default="dptrain", metadata=resumable())
    """Job id of a dynamic rendezvous, the same on every node."""
    threads: int = field(default=0, metadata=resumable())
    """Intra-op threads per process; 0: OMP_NUM_THREADS if set, else each process's share of
    the cores it may use (docs/design.md, Threads per rank)."""
    max_restarts: int = field(default=0, metadata=resumable())
    """Restart the job up to this many times after a failure; each restart resumes from the
    newest checkpoint."""
    timeout: float = field(default=300.0, metadata=resumable())
    """Seconds a collective (or the start-up rendezvous) waits for a missing rank before every
    rank fails with an error naming the operation."""

    def __post_init__(self) -> None:
        check_at_least(self, ("nproc", "nnodes"), 1)
        if not -1 <= self.node_rank < self.nnodes:
            raise bad_value(self, "node_rank",
                            f"a node rank in [0, {self.nnodes}) (or -1: dynamic)")
        if self.nnodes > 1 and ":" not in self.rdzv_endpoint:
            raise ConfigError(f"nnodes {self.nnodes} needs rdzv-endpoint HOST:PORT, the same on "
                              f"every node, got {self.rdzv_endpoint!r}")
        check_at_least(self, ("threads", "max_restarts"), 0)
        if self.timeout <= 0:
            raise bad_value(self, "timeout", "a number of seconds > 0")
