"""torchrun's rendezvous for a job: its options (`rendezvous_argv`: standalone, static, or
dynamic in c10d or etcd), torch's dynamic rendezvous settings with dptrain's defaults
(`rendezvous_conf`, `LOST_NODE_SETTINGS`), and the network interface every node's workers and
agent use to reach the others (`network_options`). The options as the user gives them, and
their checks, are `LaunchConfig`'s (dptrain.runtime.launch)."""

from __future__ import annotations

import math
import sys

from dptrain.errors import ConfigError
from dptrain.launcher.etcd_rendezvous import ETCD_HANDLER
from dptrain.runtime.launch import DEFAULT_RDZV_ID, NodeRange, etcd_members, rendezvous_settings
from dptrain.runtime.netif import export_interface, is_this_machine

LOST_NODE_SETTINGS = {
    "c10d": {"keep_alive_interval": "1", "keep_alive_max_attempt": "5", "last_call_timeout": "2"},
    "etcd": {"last_call_timeout": "2"},
}
"""dptrain's defaults for torch's dynamic rendezvous, which --rdzv-conf overrides: how soon a
lost node is noticed and the job goes on without it (docs/howto/multi_node.md, A lost node).

- keep_alive_interval=1, keep_alive_max_attempt=5 (torch: 5 and 3): every agent writes a
  heartbeat each second, and a node silent for 5 s is dropped; the agents notice it and
  restart their workers on the nodes left (dptrain.launcher.round_watch). The heartbeats are
  the agents', which do nothing else: a slow or stalled worker never misses one, so the window
  only has to cover an agent's scheduling delays and the hosts' clock skew (each heartbeat
  carries its writer's clock). With etcd torch's 5 x 3 s stays: a node whose request hangs on
  a lost member waits up to 5 s before its client moves on to another (etcd_rendezvous), plus
  an election when that member led the cluster.
- last_call_timeout=2 (torch: 30): once MIN nodes are in a round, how long it waits for more.
  After a loss the survivors arrive together and there is nobody else to wait for; at the
  start, a node that comes later than that joins a moment after, the workers restarting once
  to take it in (not counted as a restart)."""


def rendezvous_argv(nodes: NodeRange, node_rank: int | None, rdzv_endpoint: str | None,
                    rdzv_id: str, backend: str = "c10d") -> list[str]:
    """torchrun's rendezvous options: standalone on one node, else static (a node rank given)
    or dynamic (c10d) at the endpoint, elastic when `nodes` is a range; with `backend` etcd,
    dynamic in the etcd cluster the endpoint lists, on one node too. Shared by `dptrain run`
    and `dptrain train`."""
    if backend == "etcd":
        return _etcd_argv(nodes, node_rank, rdzv_endpoint or "", rdzv_id)
    if nodes.max_nodes == 1 and not rdzv_endpoint:
        return ["--standalone"]
    if not rdzv_endpoint or ":" not in rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every "
                          f"node, got {rdzv_endpoint!r}")
    host, _, port = rdzv_endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint!r}: the port must be a number")
    argv = [f"--nnodes={nodes}"]
    if node_rank is not None:
        if nodes.elastic:
            raise ConfigError(f"--node-rank {node_rank}: a static rendezvous needs a fixed "
                              f"--nnodes N, got {nodes}; leave --node-rank out for an elastic "
                              f"job")
        if not 0 <= node_rank < nodes.max_nodes:
            raise ConfigError(f"--node-rank must be in [0, {nodes.max_nodes}), got {node_rank}")
        return [*argv, "--rdzv-backend=static", f"--node-rank={node_rank}",
                f"--master-addr={host.strip('[]')}", f"--master-port={port}"]
    return [*argv, "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}"]


def _etcd_argv(nodes: NodeRange, node_rank: int | None, rdzv_endpoint: str,
               rdzv_id: str) -> list[str]:
    if node_rank is not None:
        raise ConfigError(f"--node-rank {node_rank}: the etcd rendezvous numbers the nodes "
                          f"itself; leave --node-rank out")
    members = etcd_members(rdzv_endpoint)
    if rdzv_id == DEFAULT_RDZV_ID:
        # On an etcd cluster the id is all that tells two jobs apart: two jobs that both took
        # the default would meet in one rendezvous.
        raise ConfigError(f"--rdzv-backend etcd: give the job an --rdzv-id of its own, the "
                          f"same on every node (e.g. the scheduler's job id): the jobs on an "
                          f"etcd cluster are told apart by it (not the default "
                          f"{DEFAULT_RDZV_ID!r})")
    return [f"--nnodes={nodes}", f"--rdzv-backend={ETCD_HANDLER}",
            f"--rdzv-endpoint={','.join(f'{host}:{port}' for host, port in members)}",
            f"--rdzv-id={rdzv_id}"]


def rendezvous_host(rdzv_endpoint: str | None) -> str:
    """The host every node dials: the endpoint's (an etcd cluster's first member), or this
    machine's for a standalone job."""
    if not rdzv_endpoint:
        return "localhost"
    first = rdzv_endpoint.split(",")[0].strip()
    if ":" in first and not first.endswith("]"):  # HOST:PORT, [IPV6]:PORT
        first = first.rpartition(":")[0]
    return first.strip("[]")


def rendezvous_conf(user_conf: str, timeout_s: float | None = None,
                    backend: str = "c10d", dynamic: bool = True) -> dict[str, str]:
    """torch's dynamic rendezvous settings: dptrain's for noticing a lost node in seconds
    (`LOST_NODE_SETTINGS`, when `dynamic`), `timeout_s` (dptrain train's --timeout) as the time
    to wait for the first MIN nodes (join_timeout) and for the store's host (read_timeout), then
    the user's `KEY=VALUE,...`, which win."""
    conf = dict(LOST_NODE_SETTINGS[backend]) if dynamic else {}
    if timeout_s is not None:
        seconds = str(max(1, math.ceil(timeout_s)))  # torch reads whole seconds
        conf.update(join_timeout=seconds, read_timeout=seconds)
    return {**conf, **rendezvous_settings(user_conf, backend)}


def network_options(rdzv_endpoint: str | None, max_nodes: int, backend: str = "c10d"
                    ) -> tuple[list[str], dict[str, str]]:
    """Export the interface that reaches the rendezvous host (etcd's first member) for every
    worker's gloo/NCCL, and on several nodes tell the agent this node's address on it (torch's
    default, the host name, may resolve to the loopback); extra torchrun options and rendezvous
    settings."""
    host = rendezvous_host(rdzv_endpoint)
    choice = export_interface(host, multi_node=max_nodes > 1)
    if max_nodes == 1:
        return [], {}
    print(f"dptrain: network interface {choice.name or '(left to the backends)'}: "
          f"{choice.reason}", file=sys.stderr, flush=True)
    extra = [f"--local-addr={choice.address}"] if choice.address else []
    if backend == "etcd":  # no node serves it
        return extra, {}
    # A c10d rendezvous is served by the node the endpoint names; torch recognises it by
    # its host name's addresses, which miss it when that name resolves to the loopback.
    return extra, {"is_host": str(int(is_this_machine(host)))}
