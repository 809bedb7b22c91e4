"""Run a function on N real ranks (spawned processes, gloo) with a hard deadline.

    from tests._world import run_world

    def _check_sum(rank, world_size):          # module level: spawn pickles it by name
        t = torch.tensor([rank + 1.0]); all_reduce_flat([t]); return t.item()

    assert run_world(_check_sum, world_size=2) == [3.0, 3.0]

Rendezvous is a FileStore in a fresh temp dir (no ports), or with `init="env"` the ranks get
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and start the group through `dptrain.runtime` themselves.
Each rank's stdout/stderr goes to a log file that is shown when the world fails. The parent
joins until the deadline, then kills every child and raises `TimeoutError`.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


class WorldFailed(AssertionError):
    """A rank raised or exited non-zero; the message names it and holds every rank's output."""


def free_port() -> int:
    """A port that was free a moment ago (only for tests that must exercise a real port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable, world_size: int, workdir: str, init: str,
               group_timeout_s: float, args: tuple, env: dict[str, str]) -> None:
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=group_timeout_s)
    if init == "file":
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    elif init == "env":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    with open(os.path.join(workdir, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    # torch 2.13 can abort a finished gloo+DDP process in C++ teardown (see
    # dptrain.launcher.worker.exit_without_teardown); the result is written, so leave now.
    log.flush()
    os._exit(0)


def _outputs(workdir: str, world_size: int) -> str:
    parts = []
    for r in range(world_size):
        path = Path(workdir, f"rank{r}.log")
        text = path.read_text() if path.exists() else "<no output>"
        parts.append(f"----- rank {r} -----\n{text.rstrip()}")
    return "\n".join(parts)


def run_world(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 90,
              init: str = "file", env: dict[str, str] | None = None,
              group_timeout_s: float | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results.

    `init`: "file" (group started here over a FileStore), "env" (rendezvous variables set, the
    function starts the group itself), or "none" (no group, no variables).
    """
    workdir = tempfile.mkdtemp(prefix="dptrain-world-")
    rank_env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    if init == "env":
        rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # By default a third of the deadline: a missing peer then fails inside the collective,
    # named, before the outer deadline has to kill anything.
    if group_timeout_s is None:
        group_timeout_s = max(5.0, timeout_s / 3)
    ctx = mp.start_processes(_rank_main, args=(fn, world_size, workdir, init, group_timeout_s,
                                               args, rank_env),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {world_size} still running after {timeout_s:g}s\n"
                                   f"{_outputs(workdir, world_size)}")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        raise WorldFailed(f"rank {err.error_index} failed: {err}\n"
                          f"{_outputs(workdir, world_size)}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    results = []
    for r in range(world_size):
        with open(os.path.join(workdir, f"result{r}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    shutil.rmtree(workdir, ignore_errors=True)
    return results
