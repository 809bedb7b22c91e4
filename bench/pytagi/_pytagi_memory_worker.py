"""pytagi half of tagi_conv_vs_torch.py: peak memory of one pytagi process training a network.

    python _pytagi_memory_worker.py NETWORK BATCH STEPS THREADS

Runs in bench/.venv-pytagi (needs LD_LIBRARY_PATH as for _pytagi_worker.py, whose network
builders it reuses), trains NETWORK ("cnn" or "resnet18") for STEPS steps of BATCH synthetic
samples (forward, index update, backward, step) and prints one JSON line on stdout:
{"peak_rss_mb": ..., "seconds_per_step": ..., "steps": STEPS}. Imports nothing from dptrain.
"""

import json
import os
import resource
import sys
import time

import numpy as np
from pytagi import Utils
from pytagi.nn import OutputUpdater

from _pytagi_worker import build


def main() -> None:
    network, batch, steps, threads = sys.argv[1], *map(int, sys.argv[2:5])
    out = os.fdopen(os.dup(1), "w")  # the C++ library prints to fd 1: keep it for the result
    os.dup2(2, 1)
    size = 784 if network == "cnn" else 3 * 32 * 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size)).astype(np.float32)
    utils = Utils()
    obs, idx, _ = utils.label_to_obs(rng.integers(0, 10, batch), 10)
    obs, idx = obs.astype(np.float32), idx.astype(np.int32)
    var_obs = np.full_like(obs, 0.05**2)
    net = build(network)
    net.set_threads(threads)
    updater = OutputUpdater(net.device)
    start = time.perf_counter()
    for _ in range(steps):
        net(x.reshape(-1))
        updater.update_using_indices(net.output_z_buffer, obs, var_obs, idx,
                                     net.input_delta_z_buffer)
        net.backward()
        net.step()
    seconds = (time.perf_counter() - start) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mb": peak, "seconds_per_step": seconds, "steps": steps}),
          file=out, flush=True)


if __name__ == "__main__":
    main()
