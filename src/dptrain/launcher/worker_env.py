"""What the agent passes on to the workers it starts, through their environment: their intra-op
threads and OpenMP's wait policy (docs/design.md, Threads per rank), the roll call, a store of
their own for each attempt, and that the launcher reports their errors (`LAUNCHER_REPORTS`).
"""

from __future__ import annotations

import os

from dptrain.errors import ConfigError
from dptrain.runtime.collectives import ROLL_CALL_ENV
from dptrain.runtime.threads import ThreadShare, env_threads, oversubscribed, this_process_share

LAUNCHER_REPORTS = "DPTRAIN_LAUNCHER_REPORTS"
"""Set for the workers of `launch`: it prints their expected errors, so a worker only records
one (every rank would otherwise print the same line)."""


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


def worker_environment(nproc: int, max_nodes: int) -> None:
    """Set, in this process's environment, the variables the agent passes on to every worker,
    unless the user set them."""
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


def use_threads(threads: int) -> None:
    """An explicit thread count (`--threads`): for this process and, through OMP_NUM_THREADS,
    for every process it starts and every rank's process group (which then keeps it)."""
    import torch

    if threads < 1:
        raise ConfigError(f"--threads must be >= 1 (0: the default share), got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
