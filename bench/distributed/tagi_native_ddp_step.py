"""A data-parallel rank's compiled TAGI step: the native library's deltas, then the capped step
after the all-reduce, eager (`Sequential.step()`) or the library's own.

    .venv/bin/python bench/distributed/tagi_native_ddp_step.py          # writes the JSON below
    .venv/bin/python bench/distributed/tagi_native_ddp_step.py --quick  # smoke run, writes nothing

(bench/results/tagi_native_ddp_step.json)

`DDPSequential.compile()` steps a network the native step does in three parts: the library
computes the scaled deltas of the rank's batch, the wrapper all-reduces them, then the capped
step runs with the global batch's cap. This times one rank's two local parts, the all-reduce
left out (it is the same in both), for pytagi's FNN 784-128-128-11 + HRC at 16 samples a rank
(a global batch of 32 on 2 ranks): the capped step as `Sequential.step()` (five passes of
torch over the parameters) against the library's (one pass). One thread, fresh batches from a
synthetic MNIST-shaped set every step, the two alternating over repeats; a figure is the
median over repeats, min-max beside it. "param diff": the largest parameter difference after
the first step (from the same parameters), relative to the largest parameter. Over hundreds of
steps the two drift apart, as two roundings of one training run do: torch's float32 square
root is not always correctly rounded (√0.0059364839 comes out one ulp low), the library's is,
so a step clamped at ±sqrt(v)/c can differ by an ulp, and training amplifies it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dptrain import tagi
from dptrain.tagi.base import cap_factor
from dptrain.tagi.native import NativeStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS, command_line, git_describe, hardware, write_json  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_native_ddp_step.json"
RANK_BATCH, WORLD = 16, 2


def fnn() -> tagi.Sequential:
    return tagi.Sequential(tagi.Linear(784, 128), tagi.ReLU(), tagi.Linear(128, 128),
                           tagi.ReLU(), tagi.Linear(128, 11))


def steppers(samples: int) -> dict:
    """name -> one rank's local step (deltas, then the capped step), each on its own network
    from the same seed and its own cursor through the same data."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(samples, 784, generator=g)
    idx = torch.randint(1, 12, (samples, 4), generator=g)
    y = torch.randn(samples, 4, generator=g)
    noise, factor = torch.tensor(0.05 ** 2), cap_factor(RANK_BATCH * WORLD)
    out = {}
    for name in ("eager step()", "native capped step"):
        tagi.manual_seed(0)
        net = fnn()
        native = NativeStep(net, RANK_BATCH, None, "indices")
        net.cap_batch_size = RANK_BATCH * WORLD
        cursor = [0]

        def step(net=net, native=native, cursor=cursor, eager=name.startswith("eager")):
            i = cursor[0]
            cursor[0] = (i + RANK_BATCH) % samples
            s = slice(i, i + RANK_BATCH)
            native(x[s], y[s], noise, None, False, idx[s])  # the scaled deltas
            if eager:
                net.step()
            else:
                native.step(factor)
        out[name] = (step, net)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--quick", action="store_true", help="2 repeats of 50 steps; writes nothing")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args()
    repeats, steps = (2, 50) if args.quick else (args.repeats, args.steps)
    torch.set_num_threads(1)
    runs = steppers(4096)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step, _ in runs.values():  # the first step, from the same parameters
        step()
    nets = [net for _, net in runs.values()]
    diff = float((nets[0].flat_params - nets[1].flat_params).abs().max() /
                 nets[0].flat_params.abs().max())
    for step, _ in runs.values():
        for _ in range(10):
            step()
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            step = runs[name][0]
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    rows = {name: {"ms": statistics.median(t), "ms_range": [min(t), max(t)], "runs": t}
            for name, t in times.items()}
    eager, native = (rows[name]["ms"] for name in runs)
    for name, row in rows.items():
        print(f"{name:20s} {row['ms']:.3f} ms a step ({row['ms_range'][0]:.3f}-"
              f"{row['ms_range'][1]:.3f})")
    print(f"speedup {eager / native:.2f}x; largest parameter difference after the first "
          f"step {diff:.1e} of the largest parameter")
    if not args.quick:
        write_json(args.output, {"command": command_line(), "rows": rows,
                                 "speedup": eager / native, "max_rel_param_diff": diff,
                                 "rank_batch": RANK_BATCH, "world": WORLD,
                                 "repeats": repeats, "steps": steps, "threads": 1,
                                 "hardware": hardware(), "git": git_describe(),
                                 "torch": torch.__version__})


if __name__ == "__main__":
    main()
