"""`dptrain run`: start a script on N processes per node with torch's elastic agent (torchrun)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from dptrain.runtime.launch import (DEFAULT_RDZV_ID, ETCD_HANDLER, LOST_NODE_SETTINGS,
                                    NodeRange, etcd_members, rendezvous_settings)
from dptrain.runtime.threads import ThreadShare, env_threads, oversubscribed, this_process_share
from dptrain.errors import ConfigError

LAUNCHER_REPORTS = "DPTRAIN_LAUNCHER_REPORTS"
"""Set for the workers of `launch`: it prints their expected errors, so a worker only records
one (every rank would otherwise print the same line)."""



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run a script data-parallel (torchrun underneath)",
        description="Start SCRIPT on NPROC processes per node with torch's elastic agent. One "
                    "node by default (a free port is chosen); give --nnodes and --rdzv-endpoint "
                    "on every node for more. A failing worker stops the whole job, named.")
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                   help="processes per node (default: CUDA devices, or 1 without CUDA)")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="number of nodes (default 1); MIN:MAX: elastic, the job goes on "
                        "without a lost node and takes in one that comes")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank; with it the rendezvous is static, else dynamic")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT[,...]",
                   help="rendezvous host:port reachable from every node (required if --nnodes>1);"
                        " with --rdzv-backend etcd the etcd cluster's members, h1:2379,h2:2379")
    p.add_argument("--rdzv-backend", default="c10d", choices=("c10d", "etcd"),
                   help="where the dynamic rendezvous keeps its state: c10d, in the agent of the "
                        "node the endpoint names (default); etcd, in an etcd cluster (v2 API, "
                        "dptrain[etcd]), so that no node is the one the others need")
    p.add_argument("--rdzv-id", default=DEFAULT_RDZV_ID,
                   help="job id shared by all nodes (with etcd: each job its own)")
    p.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...",
                   help="settings of torch's dynamic rendezvous (dptrain's defaults: "
                        "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5; "
                        "with etcd torch's keep-alive, 5 x 3 s); "
                        "with etcd also protocol=https, ca_cert=, ssl_cert=, ssl_cert_key= "
                        "(or cacert=, cert=, key=)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every worker up to K times after a failure (default 0)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads per process (default: OMP_NUM_THREADS if set, else "
                        "each process's share of the cores this one may use)")
    p.add_argument("script", help="python script to run on every process")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run_command)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def resolved_nproc(args: argparse.Namespace) -> int:
    return default_nproc() if args.nproc is None else args.nproc


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """torchrun's command line for our options (pure, so tests call it without processes)."""
    nproc = resolved_nproc(args)
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not os.path.isfile(args.script):
        raise ConfigError(f"script not found: {args.script}")
    nodes = NodeRange.parse(args.nnodes)
    argv = [f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}",
            *rendezvous_argv(nodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id,
                             args.rdzv_backend)]
    # The worker wrapper records a raising script's traceback for the agent's failure report.
    return [*argv, "-m", "dptrain.cli.worker", args.script, *args.script_args]


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


def _network_interface(rdzv_endpoint: str | None, max_nodes: int, backend: str = "c10d"
                       ) -> tuple[list[str], dict[str, str]]:
    """Export the interface that reaches the rendezvous host (etcd's first member) for every
    worker's gloo/NCCL, and on several nodes tell the agent this node's address on it (torch's
    default, the host name, may resolve to the loopback); extra torchrun options and rendezvous
    settings."""
    from dptrain.runtime.netif import export_interface, is_this_machine

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


def thread_environment(nproc: int, environ: dict[str, str] | os._Environ,
                       share: ThreadShare | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS and OMP_WAIT_POLICY for `nproc` workers on this node, those the user set
    left alone (docs/design.md, Threads per rank).

    torchrun would pin OMP_NUM_THREADS=1 when unset; each worker gets its share of the cores this
    process may use instead (the agent binds nothing: its workers inherit its CPU set). When the
    workers' threads outnumber those cores (OMP_NUM_THREADS or --threads above the share),
    OMP_WAIT_POLICY=PASSIVE makes OpenMP's waiting threads sleep instead of spinning for
    peers the scheduler took off a core; OpenMP reads it once, when torch loads it, so it has to
    be in the workers' environment from the start.
    """
    share = share or this_process_share(nproc, launcher_side=True)
    out = {}
    threads = env_threads(environ)
    if threads is None and "OMP_NUM_THREADS" not in environ:
        threads = share.threads
        out["OMP_NUM_THREADS"] = str(threads)
    if "OMP_WAIT_POLICY" not in environ and threads and \
            oversubscribed(nproc, threads, share.usable):
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


def _worker_environment(nproc: int, max_nodes: int) -> None:
    """Variables the agent passes on to every worker, unless the user set them."""
    from dptrain.runtime.collectives import ROLL_CALL_ENV

    os.environ.update(thread_environment(nproc, os.environ))
    if max_nodes == 1:
        # This agent watches every rank and names the one that died: a survivor reports its
        # lost peer at once instead of waiting for a roll call (dptrain.runtime.collectives).
        os.environ.setdefault(ROLL_CALL_ENV, "off")
    # With the agent's store shared, a restarted attempt can read the dead attempt's keys and
    # dial its ports (gloo: "connection refused"; pytorch/pytorch#135712): give each attempt a
    # store of its own.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Our workers record expected errors quietly: launch() prints them once.
    os.environ[LAUNCHER_REPORTS] = "1"


def launch(argv: list[str], nproc: int, command: str = "run", *,
           rdzv_endpoint: str | None = None, max_nodes: int = 1,
           rdzv_conf: dict[str, str] | None = None, end_record: Path | None = None,
           rdzv_backend: str = "c10d") -> int:
    """Run torchrun's agent with `argv` in this process. Returns 0; an expected error's own
    status with its one line; 1 naming the failed rank; or 128 + N after signal N (SIGTERM,
    Ctrl-C), the agent having stopped the workers. `end_record`: where an elastic job's agents
    record its end (`dptrain.cli.job_end`) and where a node that finds the rendezvous closed
    or gone reads why. With `rdzv_backend` etcd, an etcd cluster that cannot serve the job (no
    client installed, no member answering, no v2 API) is a ConfigError before anything
    starts."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from dptrain.cli.agent import JobStopped, _describe, _lost_peer, _our_agent, \
        expected_error, root_cause

    if rdzv_backend == "etcd":
        from dptrain.cli import etcd_rendezvous

        etcd_rendezvous.check_cluster(rdzv_endpoint or "", rdzv_conf or {})
        etcd_rendezvous.register()
    _worker_environment(nproc, max_nodes)
    extra, conf = _network_interface(rdzv_endpoint, max_nodes, rdzv_backend)
    conf.update(rdzv_conf or {})
    if conf:
        extra.append(f"--rdzv-conf={','.join(f'{k}={v}' for k, v in conf.items())}")
    argv = [*extra, *argv]
    if conf.get("is_host") == "0" and "--rdzv-backend=c10d" in argv:
        status = _wait_for_the_rendezvous(command, rdzv_endpoint or "",
                                          int(conf.get("read_timeout", STORE_TIMEOUT_S)),
                                          end_record)
        if status is not None:
            return status
    try:
        with _our_agent(command, end_record):
            run(get_args_parser().parse_args(argv))
    except RendezvousError as err:
        return _rendezvous_failed(err, command, rdzv_endpoint, end_record, rdzv_backend)
    except ChildFailedError as err:
        rank, failure = root_cause(err.failures)
        text = expected_error(failure)
        if text is not None:
            print(f"dptrain {command}: error: rank {rank}: {text}", file=sys.stderr)
            return failure.exitcode
        others = sorted(set(err.failures) - {rank})
        also = f" (rank(s) {', '.join(map(str, others))} failed after it)" if others else ""
        steps = [r["step"] for r in map(_lost_peer, err.failures.values())
                 if isinstance(r.get("step"), int)]
        at = f" at step {min(steps)}" if steps else ""
        print(f"dptrain {command}: rank {rank} failed first (exit code {failure.exitcode})"
              f"{at}{also} and the job was stopped. {_describe(failure.message)}",
              file=sys.stderr)
        return 1
    except JobStopped as err:
        print(f"dptrain {command}: {err}", file=sys.stderr)
        return 1
    except SignalException as err:
        signum = int(err.sigval)
        print(f"dptrain {command}: stopped by {signal.Signals(signum).name}; the workers were "
              f"stopped too", file=sys.stderr)
        return 128 + signum
    return 0


STORE_TIMEOUT_S = 60
"""torch's default read_timeout of the c10d rendezvous store, its wait for the store's host."""


def _wait_for_the_rendezvous(command: str, rdzv_endpoint: str, timeout_s: int,
                             end_record: Path | None) -> int | None:
    """A node that does not serve the dynamic rendezvous first waits, here, for the node that
    does: torch's C++ store client would print a stack trace at every retry. It stops waiting
    when the job's end record appears instead (the job ended before this node came). None when
    the endpoint answers; else the exit status, its one line printed."""
    from dptrain.cli import job_end
    from dptrain.runtime.netif import wait_for_listener

    host, _, port = rdzv_endpoint.rpartition(":")
    try:
        if wait_for_listener(host.strip("[]"), int(port), timeout_s, give_up=lambda: (
                end_record is not None and job_end.read(end_record) is not None)):
            return None
    except TimeoutError as err:
        print(f"dptrain {command}: {err} within {timeout_s} s: is the node it names up? It "
              f"serves the rendezvous", file=sys.stderr)
        return 1
    return job_end.report(command, end_record)


ETCD_DOCS = "docs/howto/multi_node.md, The rendezvous in etcd"
"""Where the docs say how to keep the rendezvous in etcd (named in the lost-host line)."""


def _rendezvous_failed(err: Exception, command: str, rdzv_endpoint: str | None,
                       end_record: Path | None, backend: str = "c10d") -> int:
    """One line for a rendezvous that closed or failed under this node (torch's own is a
    traceback): the job's end record when there is one (the job ended: 0 if it succeeded);
    under c10d, a store that no longer answers as the loss of the host the endpoint names,
    with the backend that survives it; else what torch said. torch's agent has stopped any
    workers it had started."""
    from torch.distributed.elastic.rendezvous import (RendezvousClosedError,
                                                      RendezvousConnectionError)

    from dptrain.cli import job_end

    status = job_end.report(command, end_record)
    if status is not None:
        return status
    if isinstance(err, RendezvousClosedError):
        print(f"dptrain {command}: the rendezvous at {rdzv_endpoint} is closed: its job has "
              f"ended; nothing to join", file=sys.stderr)
        return 1
    cause = err.__cause__  # torch wraps the store's own error, which says more
    because = f" ({type(cause).__name__}: {str(cause).splitlines()[0]})" \
        if cause is not None and str(cause) else ""
    if backend == "c10d" and isinstance(err, RendezvousConnectionError):
        # The c10d store lives in the agent of the node the endpoint names: with no end
        # record, that node is gone, and every other node's job with it.
        print(f"dptrain {command}: lost the rendezvous host {rdzv_endpoint}{because}: it served "
              f"the job's c10d rendezvous, and the job cannot go on without it; to survive the "
              f"loss of any node, keep the rendezvous in an etcd cluster with --rdzv-backend "
              f"etcd ({ETCD_DOCS})", file=sys.stderr)
        return 1
    print(f"dptrain {command}: the rendezvous at {rdzv_endpoint} failed: "
          f"{type(err).__name__}: {err}{because}", file=sys.stderr)
    return 1


def use_threads(threads: int) -> None:
    """An explicit thread count (`--threads`): for this process and, through OMP_NUM_THREADS,
    for every process it starts and every rank's process group (which then keeps it)."""
    import torch

    if threads < 1:
        raise ConfigError(f"--threads must be >= 1 (0: the default share), got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def run_command(args: argparse.Namespace) -> int:
    if args.threads:
        use_threads(args.threads)
    max_nodes = NodeRange.parse(args.nnodes).max_nodes
    dynamic = args.node_rank is None and (max_nodes > 1 or args.rdzv_backend == "etcd")
    return launch(torchrun_argv(args), resolved_nproc(args), rdzv_endpoint=args.rdzv_endpoint,
                  max_nodes=max_nodes,
                  rdzv_conf=rendezvous_conf(args.rdzv_conf, backend=args.rdzv_backend,
                                            dynamic=dynamic),
                  rdzv_backend=args.rdzv_backend)
