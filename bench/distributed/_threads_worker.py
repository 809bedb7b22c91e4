"""One rank of bench/distributed/threads_oversubscription.py, started by `dptrain run` or torchrun.

    python bench/distributed/_threads_worker.py NETWORK BATCH SECONDS WARMUP OUT_DIR

Times data-parallel TAGI training steps (sum mode, HRC head, synthetic inputs) after WARMUP
steps, with the threads and OpenMP wait policy its launcher gave it, and writes
OUT_DIR/rank<r>.json: steps, seconds, the thread count torch used, OMP_WAIT_POLICY. The ranks
agree on a step count that lasts about SECONDS (from a few calibration steps, the slowest
rank's), so a configuration that collapses costs the benchmark seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

CALIBRATION_STEPS = 5


def network(name: str, num_outputs: int):
    """FNN 784-128-128-11, or the registry's tagi-cnn on 28x28 (pytagi's MNIST CNN)."""
    from dptrain.models import build_model
    from dptrain.tagi import Linear, ReLU, Sequential

    if name == "cnn":
        return build_model("tagi-cnn", (1, 28, 28), num_outputs), (1, 28, 28)
    return Sequential(Linear(784, 128), ReLU(), Linear(128, 128), ReLU(),
                      Linear(128, num_outputs)), (784,)


def main(name: str, batch: int, budget_s: float, warmup: int, out_dir: str) -> None:
    from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed
    from dptrain.tagi.ddp import DDPConfig, DDPSequential

    config = DDPConfig.from_env(backend="gloo")
    manual_seed(0)
    hrc = HRCSoftmax(10)
    model, sample_shape = network(name, hrc.num_outputs)
    net = DDPSequential(model, config)  # starts the group: dptrain's thread share applies here
    updater = OutputUpdater()
    g = torch.Generator().manual_seed(1 + config.rank)
    x = torch.rand(8, batch, *sample_shape, generator=g)  # 8 distinct batches, cycled
    obs, idx = zip(*(hrc.encode(torch.randint(0, 10, (batch,), generator=g)) for _ in range(8)))

    def step(i: int) -> None:
        net(x[i % 8])
        updater.update_using_indices(net.output_z_buffer, obs[i % 8], 0.05**2, idx[i % 8],
                                     net.input_delta_z_buffer)
        net.backward()
        net.step()

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(CALIBRATION_STEPS):
        step(i)
    per_step = torch.tensor([(time.perf_counter() - start) / CALIBRATION_STEPS])
    if config.world_size > 1:
        torch.distributed.all_reduce(per_step, op=torch.distributed.ReduceOp.MAX)
    steps = max(CALIBRATION_STEPS, round(budget_s / per_step.item()))
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    seconds = time.perf_counter() - start
    Path(out_dir, f"rank{config.rank}.json").write_text(json.dumps({
        "steps": steps, "seconds": seconds, "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "cpus": sorted(os.sched_getaffinity(0))}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
