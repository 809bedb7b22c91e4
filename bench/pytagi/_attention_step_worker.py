"""One side of tagi_attention_vs_cutagi.py: times the training step of one attention network
written once against pytagi's API, run with `pytagi` = cuTAGI main's build or dptrain.pytagi.

    python _attention_step_worker.py MODULE THREADS STEPS T E HEADS BATCH
prints {"step_s": seconds per step (median of 5 rounds of STEPS steps)} on its last line.
"""

import importlib
import json
import statistics
import sys
import time

import numpy as np

module, threads, steps, t, e, heads, batch = sys.argv[1], *map(int, sys.argv[2:8])
nn = importlib.import_module(f"{module}.nn")
FEATURES = 8  # a small Linear makes the (B, T·E) sequence the attention reads, as cuTAGI's tests

net = nn.Sequential(nn.Linear(FEATURES, t * e), nn.MultiheadAttention(e, heads, heads))
net.set_threads(threads)
updater = nn.OutputUpdater(net.device)
rng = np.random.default_rng(0)
x = rng.standard_normal(batch * FEATURES).astype(np.float32)
y = (0.1 * rng.standard_normal(batch * t * e)).astype(np.float32)
var_y = np.full(y.shape, 0.25, dtype=np.float32)


def step() -> None:
    net(x)
    updater.update(output_states=net.output_z_buffer, mu_obs=y, var_obs=var_y,
                   delta_states=net.input_delta_z_buffer)
    net.backward()
    net.step()


for _ in range(3):  # warm-up: allocation, first-call paths
    step()
rounds = []
for _ in range(5):
    started = time.perf_counter()
    for _ in range(steps):
        step()
    rounds.append((time.perf_counter() - started) / steps)
print(json.dumps({"step_s": statistics.median(rounds)}))
