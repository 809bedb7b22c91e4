"""pytagi half of tagi_heteros_vs_pytagi.py: one training run, in bench/.venv-pytagi.

    python _pytagi_heteros_worker.py '{"data": "in.npz", "out": "out.npz", "seed": 0,
                                       "threads": 1}'

Trains pytagi's regression_heteros network (Linear(1,128)-ReLU-Linear(128,128)-ReLU-
Linear(128,2)-EvenExp, update_heteros) on the normalised data of in.npz, visiting the training
samples in the order in.npz gives per epoch and in batches of its batch size, then writes the
test predictions (mean, var of the output pairs) and the training seconds to out.npz.
Imports nothing from dptrain: that lives in the other venv.
"""

import json
import os
import sys
import time

import numpy as np
import pytagi
from pytagi.nn import EvenExp, Linear, OutputUpdater, ReLU, Sequential


def main() -> None:
    args = json.loads(sys.argv[1])
    os.dup2(2, 1)  # whatever the C++ library prints goes to stderr
    data = np.load(args["data"])
    x_train = data["x_train"].astype(np.float32)
    y_train = data["y_train"].astype(np.float32)
    x_test = data["x_test"].astype(np.float32)
    orders, batch = data["orders"], int(data["batch_size"])
    pytagi.manual_seed(args["seed"])
    net = Sequential(Linear(1, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 2),
                     EvenExp())
    net.set_threads(args["threads"])
    updater = OutputUpdater(net.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for order in orders:
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            net(x_train[idx].reshape(-1))
            updater.update_heteros(output_states=net.output_z_buffer,
                                   mu_obs=y_train[idx].reshape(-1),
                                   delta_states=net.input_delta_z_buffer)
            net.backward()
            net.step()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    net.eval()
    mus, variances = [], []
    for i in range(0, len(x_test), batch):  # pytagi sizes buffers by the first batch
        chunk = x_test[i:i + batch]
        mu, var = net(chunk.reshape(-1))
        mus.append(np.asarray(mu)[:2 * len(chunk)].reshape(-1, 2))
        variances.append(np.asarray(var)[:2 * len(chunk)].reshape(-1, 2))
    np.savez(args["out"], mu=np.concatenate(mus), var=np.concatenate(variances),
             seconds=seconds, cpu_seconds=cpu_seconds, version=pytagi.__version__.strip())


if __name__ == "__main__":
    main()
