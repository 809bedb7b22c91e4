"""Start and stop the torch process group for a resolved `DistEnv`."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from dptrain.runtime.env import DistEnv, resolve_env
from dptrain.runtime.job import attempt as job_attempt
from dptrain.runtime.netif import export_interface, wait_for_listener
from dptrain.runtime.threads import env_threads, oversubscribed, this_process_share
from dptrain.errors import ConfigError, RankFailure

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class Runtime:
    """A started (or trivially single) distributed runtime."""

    env: DistEnv
    backend: str | None
    """The process group's backend; None when world size is 1 and no group was started."""
    device: torch.device
    timeout: timedelta


def choose_backend(backend: str, env: DistEnv) -> str:
    """`auto` -> NCCL when CUDA is usable and every local rank has its own device, else gloo."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        use_nccl = gpus >= env.local_world_size and dist.is_nccl_available()
        return "nccl" if use_nccl else "gloo"
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
                 "mpi": dist.is_mpi_available}[backend]()
    if not available:
        raise ConfigError(f"backend {backend!r} is not available in this torch build "
                          f"(torch {torch.__version__}); use backend='auto' or 'gloo'")
    return backend


def device_for(env: DistEnv, backend: str | None) -> torch.device:
    """The device this rank computes on: `cuda:<local rank>` for NCCL, else the CPU."""
    if backend == "nccl":
        if torch.cuda.device_count() <= env.local_rank:
            raise ConfigError(f"rank {env.rank}: local rank {env.local_rank} has no CUDA device "
                              f"({torch.cuda.device_count()} visible)")
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def _share_cores(env: DistEnv) -> None:
    """Give this rank its share of the usable cores (dptrain.runtime.threads) unless the user, or
    the launcher (`dptrain run`, torchrun), chose a thread count in OMP_NUM_THREADS."""
    share = this_process_share(env.local_world_size)
    if env_threads(os.environ) is None:
        torch.set_num_threads(share.threads)
        log.info("rank %d: OMP_NUM_THREADS unset: %d thread(s) (%s)", env.rank, share.threads,
                 share.reason())
    threads = torch.get_num_threads()
    if env.local_rank == 0 and "OMP_WAIT_POLICY" not in os.environ and \
            oversubscribed(share.sharing, threads, share.usable):
        # OpenMP read its wait policy when torch loaded it: only the launcher can set it.
        log.warning("%d rank(s) x %d thread(s) on %d usable core(s) and OMP_WAIT_POLICY unset: "
                    "OpenMP threads spin-wait for descheduled peers and steps can stall; start "
                    "the ranks with OMP_WAIT_POLICY=PASSIVE or a lower OMP_NUM_THREADS",
                    share.sharing, threads, share.usable)


def _init_method(env: DistEnv) -> str:
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    return f"tcp://{host}:{env.master_port}"


def _attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store | None:
    """Under a torchrun agent whose store outlives a restart (static rendezvous, or a shared
    c10d store), a client of that store with keys of this attempt only; else None.

    Without the prefix a restarted attempt reads the dead attempt's gloo addresses from the
    store and dials them ("Connection refused"): every attempt rendezvouses afresh.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = job_attempt()  # the job's under dptrain's agents: a node's own count can lag
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"dptrain/attempt-{attempt}", store)


def init_distributed(env: DistEnv | None = None, *, backend: str = "auto",
                     timeout: timedelta = DEFAULT_TIMEOUT) -> Runtime:
    """Start the default process group for `env` (default: resolved from the environment).

    World size 1 starts no group. A group that is already running is reused as it is. Raises
    `RankFailure` when the other ranks do not arrive within `timeout`.
    """
    env = resolve_env() if env is None else env
    if dist.is_available() and dist.is_initialized():
        group = (dist.get_rank(), dist.get_world_size())
        if (env.rank, env.world_size) != group:
            # Started by the caller (a FileStore, a test harness): the group is the truth.
            env = replace(env, rank=group[0], world_size=group[1], local_rank=group[0],
                          local_world_size=group[1])
        used = dist.get_backend()
        return Runtime(env, used, device_for(env, used), timeout)
    if not env.is_distributed:
        chosen = choose_backend(backend, env)
        return Runtime(env, None, device_for(env, chosen), timeout)
    chosen = choose_backend(backend, env)
    device = device_for(env, chosen)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _share_cores(env)
    if chosen in ("gloo", "nccl"):
        # Before the group opens its sockets: the interface that reaches the master, not the
        # one this host name happens to resolve to (often the loopback).
        choice = export_interface(env.master_addr, env.master_port,
                                  multi_node=env.local_world_size < env.world_size)
        log.info("rank %d: network interface %s: %s", env.rank, choice.name, choice.reason)
    def failure(err: object) -> RankFailure:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return RankFailure(
            f"rank {env.rank}: could not start the {chosen} process group of {env.world_size} "
            f"ranks at {env.master_addr}:{env.master_port} ({env.launcher}) within {timeout}: "
            f"{first}; check that every rank was started, that they share MASTER_ADDR and "
            f"MASTER_PORT, and that the port is free and reachable")

    try:
        store = _attempt_store(env, timeout)
        if store is None and env.rank != 0:
            # Waited for here, in Python: torch's C++ client, left to wait for a store that
            # never comes, prints a stack trace at every retry before the error.
            wait_for_listener(env.master_addr, env.master_port, timeout.total_seconds())
        where = {"store": store} if store is not None else {"init_method": _init_method(env)}
        dist.init_process_group(chosen, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, **where)
    except (RuntimeError, dist.DistError, TimeoutError) as err:
        raise failure(err) from err
    # A script that never destroys the group leaves it to interpreter teardown, where gloo's and
    # the store's threads can die in the wrong order ("terminate called", SIGABRT at exit).
    # atexit runs the last registered first: the group goes, then its threads get their pause.
    atexit.register(_let_collective_threads_finish)
    atexit.register(shutdown_distributed)
    log.info("rank %d/%d started %s on %s", env.rank, env.world_size, chosen, device)
    return Runtime(env, chosen, device, timeout)


#: How long the process waits at exit for gloo's worker threads (see below).
EXIT_SETTLE_S = 0.1


def _let_collective_threads_finish() -> None:
    """At exit, before the interpreter finalises: give gloo's worker threads a moment.

    A worker drops its finished collective (and with it the last reference to the tensors a
    Python caller had already let go) a little after the caller sees it complete. If that falls
    after finalisation has begun, the drop needs the GIL, the thread is made to exit instead,
    and std::terminate aborts a job whose work all succeeded ("terminate called without an
    active exception"; seen in a core dump of a two-rank run under mpirun on a loaded 2-core
    machine, the last collective an all_gather_object). The worker needs microseconds once
    scheduled; the pause covers a busy machine's scheduling delay.
    """
    time.sleep(EXIT_SETTLE_S)


#: Called (last registered first) just before the group is destroyed: see release_before_shutdown.
_RELEASE_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def release_before_shutdown(release: Callable[[], None]) -> None:
    """Have `release` run when the group is shut down, before it is destroyed.

    For objects that hold the group from C++ (a DistributedDataParallel reducer): freed after
    the group, at interpreter teardown, they make torch 2.13 abort a finished job now and then
    ("terminate called without an active exception"). A script's `with distributed():` ends
    before that teardown while its learner is still alive, so atexit alone comes too late.
    """
    _RELEASE_BEFORE_SHUTDOWN.append(release)


def shutdown_distributed() -> None:
    """Destroy the default process group if one is running; safe to call twice."""
    while _RELEASE_BEFORE_SHUTDOWN:
        _RELEASE_BEFORE_SHUTDOWN.pop()()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(env: DistEnv | None = None, *, backend: str = "auto",
                timeout: timedelta = DEFAULT_TIMEOUT) -> Iterator[Runtime]:
    """`with distributed() as rt:` starts the group and always shuts it down."""
    runtime = init_distributed(env, backend=backend, timeout=timeout)
    try:
        yield runtime
    finally:
        shutdown_distributed()
