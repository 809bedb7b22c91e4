"""`LaunchConfig`: how the processes of a job are started and how long they wait for each other.

None of it changes what a run computes: a run may resume with other values (docs/design.md,
contract 8), e.g. on more processes from an epoch-end checkpoint, or on fewer nodes after one
was lost (`nnodes` MIN:MAX, an elastic job).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.errors import ConfigError
from dptrain.options import bad_value, check_at_least, resumable


@dataclass(frozen=True)
class NodeRange:
    """How many nodes a job runs on: `min_nodes` == `max_nodes` for a fixed number, else an
    elastic job that goes on with as few as `min_nodes` and takes up to `max_nodes`."""

    min_nodes: int
    max_nodes: int

    @classmethod
    def parse(cls, text: str | int) -> NodeRange:
        """"N" or "MIN:MAX" (torchrun's spelling), 1 <= MIN <= MAX; one line otherwise."""
        parts = str(text).strip().split(":")
        if 1 <= len(parts) <= 2 and all(p.strip().isdigit() for p in parts):
            low, high = int(parts[0]), int(parts[-1])
            if 1 <= low <= high:
                return cls(low, high)
        raise ConfigError(f"nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    def __str__(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(self.max_nodes)


RENDEZVOUS_SETTINGS = ("join_timeout", "last_call_timeout", "close_timeout",
                       "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt",
                       "read_timeout", "is_host")
"""The settings torch's c10d rendezvous reads (torch/distributed/elastic/rendezvous/
dynamic_rendezvous.py and c10d_rendezvous_backend.py); all integers (is_host: 0 or 1)."""


def rendezvous_settings(text: str) -> dict[str, str]:
    """`KEY=VALUE,...` (torchrun's --rdzv-conf) as a dict; an unknown key or a value that is
    not an integer is one line naming it."""
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in RENDEZVOUS_SETTINGS:
            raise ConfigError(f"rdzv-conf: expected KEY=VALUE items with KEY one of "
                              f"{', '.join(RENDEZVOUS_SETTINGS)}, got {item!r}")
        if not value.isdigit():
            raise ConfigError(f"rdzv-conf: {key} must be a whole number (seconds or a count), "
                              f"got {value!r}")
        settings[key] = value
    return settings


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Processes per node, nodes, rendezvous, threads, restarts and timeouts."""

    nproc: int = field(default=2, metadata=resumable())
    """Processes on this machine (one per device)."""
    nnodes: str = field(default="1", metadata=resumable(metavar="N|MIN:MAX"))
    """Nodes of the job: start the same command on each, with the same rdzv-endpoint. MIN:MAX
    makes it elastic: a lost node makes the others go on without it (from the newest
    checkpoint, as long as MIN nodes are left), a node that comes (back) joins at once."""
    node_rank: int = field(default=-1, metadata=resumable())
    """This node's rank, 0 .. nnodes-1 (static rendezvous); -1: torch assigns it (dynamic)."""
    rdzv_endpoint: str = field(default="", metadata=resumable(metavar="HOST:PORT"))
    """Rendezvous HOST:PORT every node reaches (node 0's for a static rendezvous); needed when
    nnodes > 1."""
    rdzv_id: str = field(default="dptrain", metadata=resumable())
    """Job id of a dynamic rendezvous, the same on every node; an elastic job that ended keeps
    its id (a node that comes later exits), so a new job needs another."""
    rdzv_conf: str = field(default="", metadata=resumable(metavar="KEY=VALUE,..."))
    """Settings of torch's dynamic rendezvous, e.g. last_call_timeout=30 (seconds it waits for
    more nodes once MIN are in), keep_alive_interval=5 and keep_alive_max_attempt=3 (a node
    silent for 3 x 5 s is dropped); join_timeout is --timeout."""
    threads: int = field(default=0, metadata=resumable())
    """Intra-op threads per process; 0: OMP_NUM_THREADS if set, else each process's share of
    the cores it may use (docs/design.md, Threads per rank)."""
    max_restarts: int = field(default=0, metadata=resumable())
    """Restart the job up to this many times after a failure (a lost node included; a node
    that joins an elastic job costs none); each restart resumes from the newest checkpoint."""
    timeout: float = field(default=300.0, metadata=resumable())
    """Seconds a collective (or the start-up rendezvous) waits for a missing rank before every
    rank fails with an error naming the operation."""

    def __post_init__(self) -> None:
        check_at_least(self, ("nproc",), 1)
        nodes = NodeRange.parse(self.nnodes)
        object.__setattr__(self, "nnodes", str(nodes))  # one spelling: 2 and "2" alike
        if nodes.elastic and self.node_rank != -1:
            raise ConfigError(f"node-rank {self.node_rank}: a static rendezvous needs a fixed "
                              f"nnodes N, got {self.nnodes}; leave node-rank out for an "
                              f"elastic job")
        if not -1 <= self.node_rank < nodes.max_nodes:
            raise bad_value(self, "node_rank",
                            f"a node rank in [0, {nodes.max_nodes}) (or -1: dynamic)")
        if nodes.max_nodes > 1 and ":" not in self.rdzv_endpoint:
            raise ConfigError(f"nnodes {self.nnodes} needs rdzv-endpoint HOST:PORT, the same on "
                              f"every node, got {self.rdzv_endpoint!r}")
        rendezvous_settings(self.rdzv_conf)
        check_at_least(self, ("threads", "max_restarts"), 0)
        if self.timeout <= 0:
            raise bad_value(self, "timeout", "a number of seconds > 0")

    @property
    def nodes(self) -> NodeRange:
        return NodeRange.parse(self.nnodes)
