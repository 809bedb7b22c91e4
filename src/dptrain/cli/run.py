"""`dptrain run`: start a script on N processes per node with torch's elastic agent (torchrun)."""

from __future__ import annotations

import argparse
import os

from dptrain.errors import ConfigError
from dptrain.launcher.launch import launch
from dptrain.launcher.rendezvous import rendezvous_argv, rendezvous_conf
from dptrain.launcher.worker_env import use_threads
from dptrain.runtime.launch import DEFAULT_RDZV_ID, NodeRange


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
    return [*argv, "-m", "dptrain.launcher.worker", args.script, *args.script_args]


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
