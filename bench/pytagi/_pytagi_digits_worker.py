"""pytagi half of pytagi_digits_reference.py: one training run, in bench/.venv-pytagi.

    python _pytagi_digits_worker.py '{"data": "in.npz", "network": "fnn", "seed": 0,
                                      "threads": 1}'

Trains the network (the FNN 64-128-128-11 or the 8x8 CNN of tests/unit/tagi/test_learning.py,
or with "network": "cnn-plan", "shape": [C, H, W] and "gain": g the registry's tagi-cnn layout
for that image shape, all from pytagi's own layers) with the hierarchical softmax head on
in.npz's training images, visiting them in the order in.npz gives per epoch, in batches of its
batch size (the last one of an epoch smaller), with σ_v from in.npz; then decodes the test predictions with pytagi's own
HRC utilities and prints one JSON line: test error, wrong count, training seconds, version, and
the largest standard deviation over the test set of one output's predicted mean.
Imports nothing from dptrain: that lives in the other venv.
"""

import json
import os
import sys
import time

import numpy as np
import pytagi
from pytagi import Utils
from pytagi.nn import AvgPool2d, Conv2d, Linear, OutputUpdater, ReLU, Sequential

NUM_CLASSES = 10


def _stage_out(size, conv_k, conv_p, pool_k, pool_s):
    size = size + 2 * conv_p - conv_k + 1
    return (size - pool_k) // pool_s + 1


def build_plan(shape, gain):
    """dptrain's tagi-cnn (learners/models.py, `tagi_cnn` and `_cnn_plan`) in pytagi layers."""
    c, h, w = shape
    plan = [(4, 1, 3, 2), (5, 0, 3, 2)] if min(h, w) >= 24 else [(3, 1, 2, 2), (3, 1, 2, 2)]
    hidden = 100 if min(h, w) >= 24 else 64
    g = {"gain_weight": gain, "gain_bias": gain}
    layers, channels = [], c
    for out_c, (k, p, pk, ps) in zip((16, 32), plan):
        size = {"in_width": w, "in_height": h} if not layers else {}
        layers += [Conv2d(channels, out_c, k, padding=p, **size, **g), ReLU(),
                   AvgPool2d(pk, ps)]
        channels = out_c
        h, w = _stage_out(h, k, p, pk, ps), _stage_out(w, k, p, pk, ps)
    return Sequential(*layers, Linear(channels * h * w, hidden, **g), ReLU(),
                      Linear(hidden, 11, **g))


def build(network, args=None):
    if network == "cnn-plan":
        return build_plan(args["shape"], args["gain"])
    if network == "fnn":
        return Sequential(Linear(64, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 11))
    # AvgPool2d(2, 2): pytagi's default stride of -1 gives a wrong output size (docs/tagi.md,
    # Departures from pytagi).
    return Sequential(Conv2d(1, 16, 3, padding=1, in_width=8, in_height=8), ReLU(),
                      AvgPool2d(2, 2), Conv2d(16, 32, 3, padding=1), ReLU(), AvgPool2d(2, 2),
                      Linear(128, 64), ReLU(), Linear(64, 11))


def main() -> None:
    args = json.loads(sys.argv[1])
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # whatever the C++ library prints goes to stderr
    data = np.load(args["data"])
    x_train = data["x_train"].astype(np.float32).reshape(len(data["y_train"]), -1)
    x_test = data["x_test"].astype(np.float32).reshape(len(data["y_test"]), -1)
    y_train, y_test = data["y_train"], data["y_test"]
    batch, sigma_v = int(data["batch_size"]), float(data["sigma_v"])
    utils = Utils()
    hrc = utils.get_hierarchical_softmax(NUM_CLASSES)
    pytagi.manual_seed(args["seed"])
    net = build(args["network"], args)
    net.set_threads(args["threads"])
    updater = OutputUpdater(net.device)
    start = time.perf_counter()
    for order in data["orders"]:
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            obs, obs_idx, _ = utils.label_to_obs(y_train[idx], NUM_CLASSES)
            net(x_train[idx].reshape(-1))
            updater.update_using_indices(net.output_z_buffer, obs.astype(np.float32),
                                         np.full(len(obs), sigma_v**2, np.float32),
                                         obs_idx.astype(np.int32), net.input_delta_z_buffer)
            net.backward()
            net.step()
    seconds = time.perf_counter() - start
    net.eval()
    wrong, outputs = 0, []
    for i in range(0, len(x_test), batch):  # a batch larger than the first breaks pytagi
        chunk = x_test[i:i + batch]
        mu, var = net(chunk.reshape(-1))
        width = hrc.len * len(chunk)  # the output buffer keeps the first batch's size
        pred, _ = utils.get_labels(np.asarray(mu)[:width], np.asarray(var)[:width], hrc,
                                   NUM_CLASSES, len(chunk))
        wrong += int(np.sum(np.asarray(pred) != y_test[i:i + batch]))
        outputs.append(np.asarray(mu)[:width].reshape(len(chunk), hrc.len))
    spread = float(np.concatenate(outputs).astype(np.float64).std(0).max())
    reply = {"test_error": wrong / len(x_test), "wrong": wrong, "seconds": seconds,
             "output_spread": spread, "version": pytagi.__version__.strip()}
    os.write(real_stdout, (json.dumps(reply) + "\n").encode())


if __name__ == "__main__":
    main()
