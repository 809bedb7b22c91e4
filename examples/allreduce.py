"""Smallest data-parallel program: every rank contributes rank+1, every rank checks the sum.

    dptrain run -n 2 examples/allreduce.py
    torchrun --standalone --nproc-per-node 2 examples/allreduce.py
    mpirun -np 2 python examples/allreduce.py
"""

import argparse

import torch

from dptrain.runtime import all_reduce_flat, distributed, rank_zero_print

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--numel", type=int, default=4, help="elements per tensor")
parser.add_argument("--fail-rank", type=int, default=None, help="this rank raises (for testing)")
args = parser.parse_args()

with distributed() as rt:
    env = rt.env
    if args.fail_rank == env.rank:
        raise RuntimeError(f"rank {env.rank} fails on purpose (--fail-rank)")
    values = torch.full((args.numel,), float(env.rank + 1))
    all_reduce_flat([values])
    expected = env.world_size * (env.world_size + 1) / 2
    if not torch.all(values == expected):
        raise SystemExit(f"rank {env.rank}: all-reduce gave {values.tolist()}, expected {expected}")
    print(f"rank {env.rank}/{env.world_size} ({env.launcher}): all-reduce sum {values[0].item():g} "
          f"ok", flush=True)
    rank_zero_print(f"all {env.world_size} ranks agree")
