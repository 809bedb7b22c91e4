"""The distributed runtime: who am I, start the process group, and collectives.

    from dptrain.runtime import distributed, all_reduce_flat, rank_zero_print
    import torch

    with distributed() as rt:              # torchrun, mpirun, srun, or a single process
        t = torch.full((3,), float(rt.env.rank + 1))
        all_reduce_flat([t])               # sum over ranks, in place
        rank_zero_print(rt.env.launcher, t.tolist())
"""

from dptrain.runtime.collectives import (
    all_gather_object,
    all_reduce_flat,
    barrier,
    broadcast_object,
    broadcast_tensors,
    collective_seconds,
    count_collective_seconds,
    get_rank,
    get_world_size,
    is_initialized,
    is_main_process,
    means,
    reduce_sum_count,
)
from dptrain.runtime.config import DDPConfig
from dptrain.runtime.env import DistEnv, expand_hostlist, resolve_env
from dptrain.runtime.group import (
    Runtime,
    choose_backend,
    distributed,
    init_distributed,
    release_before_shutdown,
    shutdown_distributed,
)
from dptrain.runtime.rank_zero import rank_zero_print, setup_logging

__all__ = [
    "DDPConfig", "DistEnv", "Runtime", "all_gather_object", "all_reduce_flat", "barrier",
    "broadcast_object", "broadcast_tensors", "choose_backend", "collective_seconds",
    "count_collective_seconds", "distributed", "expand_hostlist",
    "get_rank", "get_world_size", "init_distributed", "is_initialized", "is_main_process", "means",
    "rank_zero_print", "reduce_sum_count", "release_before_shutdown", "resolve_env", "setup_logging",
    "shutdown_distributed",
]
