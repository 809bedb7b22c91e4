"""`dptrain env`: what a user debugging a distributed job needs to see, with hints for known traps."""

from __future__ import annotations

import argparse
import os
import platform
import shutil

from dptrain.runtime.threads import (
    ThreadShare,
    affinity,
    env_threads,
    oversubscribed,
    this_process_share,
)
from dptrain.errors import ConfigError

RELEVANT_PREFIXES = ("MASTER_", "NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "OMP_", "MKL_",
                     "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_", "WORLD_SIZE", "GROUP_RANK",
                     "OMPI_COMM_WORLD_", "PMI_RANK", "PMI_SIZE", "MPI_LOCAL", "SLURM_PROCID",
                     "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_JOB_NODELIST",
                     "SLURM_NODELIST", "SLURM_NODEID", "SLURM_TASKS_PER_NODE")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", help="print versions, rank environment, backends, hints")
    p.add_argument("-n", "--nproc", type=int, default=2,
                   help="outside a launcher: show the threads of each of this many processes as "
                        "`dptrain run -n`/`dptrain train --nproc` would start them (default 2)")
    p.set_defaults(func=env_command)


def relevant_variables(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if k.startswith(RELEVANT_PREFIXES)}


def hints(environ: dict[str, str], local_world_size: int, cuda_devices: int,
          cpus: int | None = None, launched: bool = True) -> list[str]:
    """Known traps that the environment shows (pure: tests pass a dict). `local_world_size`
    ranks share `cpus` usable cores; `launched`: this process is one of them (else `dptrain
    run`/`train` will start them and share the cores)."""
    out = []
    cpus = cpus or os.cpu_count() or 1
    threads = env_threads(environ)
    if threads and oversubscribed(local_world_size, threads, cpus) and \
            environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        out.append(f"{local_world_size} rank(s) x OMP_NUM_THREADS={threads} on {cpus} usable "
                   f"core(s): OpenMP threads spin-wait for descheduled peers and every op "
                   f"stalls (measured here: 2-thread TAGI steps up to 20x slower on a busy "
                   f"2-core machine); lower OMP_NUM_THREADS or set OMP_WAIT_POLICY=PASSIVE in "
                   f"the launcher's environment (`dptrain run`/`train` set it for their "
                   f"workers; under mpirun or srun set it yourself)")
    if launched and local_world_size > 1 and "OMP_NUM_THREADS" not in environ:
        out.append(f"OMP_NUM_THREADS is unset with {local_world_size} local ranks: a plain torch "
                   f"process starts one thread per core and oversubscribes the CPU; dptrain "
                   f"gives each rank its share when it starts the group (the `threads per "
                   f"rank` line), `dptrain run`/`train` export it for you")
    if environ.get("NCCL_P2P_DISABLE") == "1":
        out.append("NCCL_P2P_DISABLE=1 routes GPU-to-GPU traffic through host memory: needed on "
                   "some consumer GPUs without P2P support, much slower elsewhere")
    if environ.get("NCCL_IB_DISABLE") == "1":
        out.append("NCCL_IB_DISABLE=1: InfiniBand is off and NCCL falls back to TCP sockets")
    if "NCCL_SOCKET_IFNAME" not in environ and cuda_devices and "SLURM_JOB_NODELIST" in environ:
        out.append("multi-node NCCL without NCCL_SOCKET_IFNAME may pick an interface the other "
                   "nodes cannot reach (docker0, a VPN); set it to the cluster network's")
    if environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL":
        out.append("TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective and slows training: "
                   "use it to find a mismatch, not for production runs")
    if os.geteuid() == 0 and shutil.which("mpirun") and \
            "OMPI_ALLOW_RUN_AS_ROOT" not in environ:
        out.append("running as root: OpenMPI's mpirun refuses unless you pass "
                   "--allow-run-as-root (or set OMPI_ALLOW_RUN_AS_ROOT=1 and "
                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)")
    return out


def network_line(env, environ: dict[str, str]) -> str:
    """The interface gloo and NCCL will use, and why (as the process group would choose it)."""
    from dptrain.runtime.netif import choose_interface

    if not env.is_distributed and not env.master_addr:
        return ("network interface: none needed (one process); `dptrain run`/`train` and "
                "workers under a launcher use the one that reaches the rendezvous host")
    choice = choose_interface(env.master_addr, env.master_port,
                              multi_node=env.local_world_size < env.world_size, environ=environ)
    address = f" ({choice.address})" if choice.address else ""
    return (f"network interface: {choice.name or 'left to gloo/NCCL'}{address}: "
            f"{choice.reason}")


def _cpu_list(cpus: frozenset[int] | None) -> str:
    """`0-3,8` for {0, 1, 2, 3, 8}."""
    if not cpus:
        return "unknown"
    ranges, ordered = [], sorted(cpus)
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(f"{start}-{prev}" if prev > start else str(start))
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)


def thread_lines(share: ThreadShare, environ: dict[str, str], launched: bool) -> list[str]:
    """What each rank gets and why: intra-op threads and OpenMP's wait policy (pure)."""
    from dptrain.launcher.worker_env import thread_environment

    who = "this rank" if launched else \
        f"each of {share.local_ranks} process(es) of `dptrain run -n {share.local_ranks}`"
    user = env_threads(environ)
    if "OMP_NUM_THREADS" in environ:
        lines = [f"threads per rank: {user or environ['OMP_NUM_THREADS']} for {who}, from "
                 f"OMP_NUM_THREADS (the share would be {share.threads}: {share.reason()})"]
    else:
        lines = [f"threads per rank: {share.threads} for {who}: {share.reason()}"]
    threads = user or share.threads
    sharing = share.sharing if launched else share.local_ranks
    over = oversubscribed(sharing, threads, share.usable)
    if "OMP_WAIT_POLICY" in environ:
        policy = f"{environ['OMP_WAIT_POLICY']} (set in the environment)"
    elif launched:
        policy = ("OpenMP's default, threads spin before sleeping" +
                  (f" (oversubscribed: {sharing} x {threads} threads on {share.usable} "
                   f"core(s), see the hint)" if over else ""))
    else:
        chosen = thread_environment(share.local_ranks, environ, share).get("OMP_WAIT_POLICY")
        policy = (f"{chosen}, set by `dptrain run`/`train`: {sharing} x {threads} threads on "
                  f"{share.usable} core(s)" if chosen else
                  "OpenMP's default (threads spin before sleeping): no more threads than cores")
    lines.append(f"OpenMP wait policy: {policy}")
    return lines


def env_command(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from dptrain._version import __version__
    from dptrain.runtime import resolve_env

    environ = dict(os.environ)
    lines = [f"dptrain {__version__}", f"torch {torch.__version__}",
             f"python {platform.python_version()} on {platform.platform()}",
             f"cpus: {os.cpu_count()} on the machine, usable by this process: "
             f"{_cpu_list(affinity())}"]
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(f"cuda: {'%d device(s): ' % cuda + ', '.join(torch.cuda.get_device_name(i) for i in range(cuda)) if cuda else 'not available'}")
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                "mpi": dist.is_mpi_available()}
    lines.append("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                          for k, v in backends.items()))
    lines.append(f"mpirun: {shutil.which('mpirun') or 'not found'}  "
                 f"srun: {shutil.which('srun') or 'not found'}")
    local_world_size, launched = 1, False
    try:
        env = resolve_env()
        local_world_size, launched = env.local_world_size, env.launcher != "single"
        lines.append(f"launcher: {env.launcher}  rank {env.rank}/{env.world_size}  local rank "
                     f"{env.local_rank}/{env.local_world_size}  node {env.node_rank}  "
                     f"master {env.master_addr or '-'}:{env.master_port or '-'}")
        lines.append(network_line(env, environ))
    except ConfigError as err:
        lines.append(f"launcher: cannot resolve the rank environment: {err}")
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    share = this_process_share(local_world_size) if launched else \
        this_process_share(args.nproc, launcher_side=True)
    lines += thread_lines(share, environ, launched)
    variables = relevant_variables(environ)
    lines.append("variables:" if variables else "variables: none of the relevant ones are set")
    lines += [f"  {k}={v}" for k, v in variables.items()]
    sharing = share.sharing if launched else share.local_ranks
    for hint in hints(environ, sharing, cuda, cpus=share.usable, launched=launched):
        lines.append(f"HINT: {hint}")
    print("\n".join(lines))
    return 0
