"""`LaunchConfig`: how the processes of a job are started and how long they wait for each other.

None of it changes what a run computes: a run may resume with other values (docs/design.md,
contract 8), e.g. on more processes from an epoch-end checkpoint, or on fewer nodes after one
was lost (`nnodes` MIN:MAX, an elastic job).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

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

ETCD_SETTINGS = {"protocol": "protocol", "ca_cert": "ca_cert", "ssl_cert": "ssl_cert",
                 "ssl_cert_key": "ssl_cert_key",
                 "cacert": "ca_cert", "cert": "ssl_cert", "key": "ssl_cert_key"}
"""The etcd client's TLS settings, by the name given -> torch's etcd-v2 name (the first four;
the last three are the legacy etcd backend's and etcdctl's spellings of the same)."""

ETCD_PORT = 2379
"""etcd's client port, for a member given without one."""
DEFAULT_RDZV_ID = "dptrain"


def rendezvous_settings(text: str, backend: str = "c10d") -> dict[str, str]:
    """`KEY=VALUE,...` (torchrun's --rdzv-conf) as a dict; an unknown key, a value that is not
    an integer, or (etcd) an unknown protocol or a certificate file that is not there is one
    line naming it. etcd's TLS keys are given their torch names."""
    settings = {}
    known = RENDEZVOUS_SETTINGS + (tuple(ETCD_SETTINGS) if backend == "etcd" else ())
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in known:
            raise ConfigError(f"rdzv-conf: expected KEY=VALUE items with KEY one of "
                              f"{', '.join(known)}, got {item!r}")
        if key in ETCD_SETTINGS and backend == "etcd":
            settings[ETCD_SETTINGS[key]] = _etcd_setting(key, value)
            continue
        if not value.isdigit():
            raise ConfigError(f"rdzv-conf: {key} must be a whole number (seconds or a count), "
                              f"got {value!r}")
        settings[key] = value
    return settings


def _etcd_setting(key: str, value: str) -> str:
    if key == "protocol":
        if value.lower() not in ("http", "https"):
            raise ConfigError(f"rdzv-conf: protocol must be http or https, got {value!r}")
        return value.lower()
    if not os.path.isfile(value):
        raise ConfigError(f"rdzv-conf: {key}: no such file {value!r}")
    return value


def etcd_members(text: str) -> list[tuple[str, int]]:
    """The members of an etcd cluster, `HOST[:PORT],...` (2379 when no port; an IPv6 address
    in brackets), as (host, port); one line when there is none or a port is not a number."""
    members = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, port = item, str(ETCD_PORT)
        if item.rpartition(":")[0] and not item.endswith("]"):
            host, _, port = item.rpartition(":")
        if not port.isdigit() or not host or (":" in host and not host.startswith("[")):
            raise ConfigError(f"rdzv-endpoint {text!r}: expected the etcd cluster's members as "
                              f"HOST:PORT,HOST:PORT,... (an IPv6 address in brackets), got "
                              f"{item!r}")
        members.append((host, int(port)))
    if not members:
        raise ConfigError("rdzv-backend etcd needs rdzv-endpoint: the etcd cluster's members, "
                          "HOST:PORT,HOST:PORT,..., the same on every node")
    return members


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
    rdzv_endpoint: str = field(default="", metadata=resumable(metavar="HOST:PORT[,...]"))
    """Rendezvous HOST:PORT every node reaches (node 0's for a static rendezvous); needed when
    nnodes > 1. With rdzv-backend etcd: the etcd cluster's members, HOST:PORT,HOST:PORT,..."""
    rdzv_backend: Literal["c10d", "etcd"] = field(default="c10d",
                                                  metadata=resumable(choices=True))
    """Where a dynamic rendezvous keeps its state: c10d, in the agent of the node the endpoint
    names; etcd, in an etcd cluster (v2 API, dptrain[etcd]), so that no node is the one the
    others need (one node too: a job of its own on a shared cluster)."""
    rdzv_id: str = field(default=DEFAULT_RDZV_ID, metadata=resumable())
    """Job id of a dynamic rendezvous, the same on every node; an elastic job that ended keeps
    its id (a node that comes later exits), so a new job needs another. With etcd it is what
    tells the jobs on the cluster apart: give each job its own."""
    rdzv_conf: str = field(default="", metadata=resumable(metavar="KEY=VALUE,..."))
    """Settings of torch's dynamic rendezvous: last_call_timeout (seconds it waits for more
    nodes once MIN are in; dptrain: 2), keep_alive_interval and keep_alive_max_attempt (a node
    whose agent is silent for their product is dropped and the others go on without it;
    dptrain: 1 x 5 s, with etcd torch's 5 x 3 s); join_timeout is --timeout. With etcd also its
    TLS: protocol=https, ca_cert=, ssl_cert=, ssl_cert_key= (or cacert=, cert=, key=)."""
    threads: int = field(default=0, metadata=resumable())
    """Intra-op threads per process; 0: OMP_NUM_THREADS if set, else each process's share of
    the cores it may use (docs/design.md, Threads per rank)."""
    max_restarts: int = field(default=0, metadata=resumable())
    """Restart the job up to this many times after a failure (a lost node included; a node
    that joins an elastic job costs none); each restart resumes from the newest checkpoint."""
    timeout: float = field(default=300.0, metadata=resumable())
    """Seconds a collective (or the start-up rendezvous) waits for a missing rank before every
    rank fails with an error naming the operation: as long as a rank may stall (a straggler, a
    long checkpoint write). A lost node of an elastic job is noticed sooner, by its agent's
    missing heartbeats (rdzv-conf)."""

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
        if self.rdzv_backend not in ("c10d", "etcd"):
            raise bad_value(self, "rdzv_backend", "c10d or etcd")
        if self.rdzv_backend == "etcd":
            etcd_members(self.rdzv_endpoint)
            if self.node_rank != -1:
                raise ConfigError(f"node-rank {self.node_rank}: the etcd rendezvous numbers the "
                                  f"nodes itself; leave node-rank out")
        elif nodes.max_nodes > 1 and ":" not in self.rdzv_endpoint:
            raise ConfigError(f"nnodes {self.nnodes} needs rdzv-endpoint HOST:PORT, the same on "
                              f"every node, got {self.rdzv_endpoint!r}")
        rendezvous_settings(self.rdzv_conf, self.rdzv_backend)
        check_at_least(self, ("threads", "max_restarts"), 0)
        if self.timeout <= 0:
            raise bad_value(self, "timeout", "a number of seconds > 0")

    @property
    def nodes(self) -> NodeRange:
        return NodeRange.parse(self.nnodes)
