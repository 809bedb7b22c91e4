"""`dptrain run`: start a script on N processes per node with torch's elastic agent (torchrun)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from dptrain.dist.threads import ThreadShare, env_threads, oversubscribed, this_process_share
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
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank; with it the rendezvous is static, else dynamic")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="rendezvous host:port reachable from every node (required if --nnodes>1)")
    p.add_argument("--rdzv-id", default="dptrain", help="job id shared by all nodes")
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
    argv = [f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}",
            *rendezvous_argv(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id)]
    # The worker wrapper records a raising script's traceback for the agent's failure report.
    return [*argv, "-m", "dptrain.cli.worker", args.script, *args.script_args]


def rendezvous_argv(nnodes: int, node_rank: int | None, rdzv_endpoint: str | None,
                    rdzv_id: str) -> list[str]:
    """torchrun's rendezvous options: standalone on one node, else static (a node rank given)
    or dynamic (c10d) at the endpoint. Shared by `dptrain run` and `dptrain train`."""
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}")
    if nnodes == 1 and not rdzv_endpoint:
        return ["--standalone"]
    if not rdzv_endpoint or ":" not in rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every "
                          f"node, got {rdzv_endpoint!r}")
    host, _, port = rdzv_endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint!r}: the port must be a number")
    argv = [f"--nnodes={nnodes}"]
    if node_rank is not None:
        if not 0 <= node_rank < nnodes:
            raise ConfigError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
        return [*argv, "--rdzv-backend=static", f"--node-rank={node_rank}",
                f"--master-addr={host.strip('[]')}", f"--master-port={port}"]
    return [*argv, "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}"]


def rendezvous_host(rdzv_endpoint: str | None) -> str:
    """The host every node dials: the endpoint's, or this machine's for a standalone job."""
    if not rdzv_endpoint:
        return "localhost"
    return rdzv_endpoint.rpartition(":")[0].strip("[]")


def _network_interface(rdzv_endpoint: str | None, nnodes: int) -> list[str]:
    """Export the interface that reaches the rendezvous host for every worker's gloo/NCCL, and
    on several nodes tell the agent this node's address on it (torch's default, the host name,
    may resolve to the loopback); extra torchrun options."""
    from dptrain.dist.netif import export_interface, is_this_machine

    host = rendezvous_host(rdzv_endpoint)
    choice = export_interface(host, multi_node=nnodes > 1)
    if nnodes == 1:
        return []
    print(f"dptrain: network interface {choice.name or '(left to the backends)'}: "
          f"{choice.reason}", file=sys.stderr, flush=True)
    extra = [f"--local-addr={choice.address}"] if choice.address else []
    # A dynamic rendezvous is served by the node the endpoint names; torch recognises it by
    # its host name's addresses, which miss it when that name resolves to the loopback.
    return [*extra, f"--rdzv-conf=is_host={int(is_this_machine(host))}"]


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


def _worker_environment(nproc: int, nnodes: int) -> None:
    """Variables the agent passes on to every worker, unless the user set them."""
    from dptrain.dist.collectives import ROLL_CALL_ENV

    os.environ.update(thread_environment(nproc, os.environ))
    if nnodes == 1:
        # This agent watches every rank and names the one that died: a survivor reports its
        # lost peer at once instead of waiting for a roll call (dptrain.dist.collectives).
        os.environ.setdefault(ROLL_CALL_ENV, "off")
    # With the agent's store shared, a restarted attempt can read the dead attempt's keys and
    # dial its ports (gloo: "connection refused"; pytorch/pytorch#135712): give each attempt a
    # store of its own.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Our workers record expected errors quietly: launch() prints them once.
    os.environ[LAUNCHER_REPORTS] = "1"


def launch(argv: list[str], nproc: int, command: str = "run", *,
           rdzv_endpoint: str | None = None, nnodes: int = 1) -> int:
    """Run torchrun's agent with `argv` in this process. Returns 0; an expected error's own
    status with its one line; 1 naming the failed rank; or 128 + N after signal N (SIGTERM,
    Ctrl-C), the agent having stopped the workers."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from dptrain.cli.agent import JobStopped, _describe, _lost_peer, _our_agent, \
        expected_error, root_cause

    _worker_environment(nproc, nnodes)
    argv = [*_network_interface(rdzv_endpoint, nnodes), *argv]
    try:
        with _our_agent(command):
            run(get_args_parser().parse_args(argv))
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
    return launch(torchrun_argv(args), resolved_nproc(args), rdzv_endpoint=args.rdzv_endpoint,
                  nnodes=args.nnodes)
