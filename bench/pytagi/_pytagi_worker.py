"""pytagi half of tagi_vs_pytagi.py: runs in bench/.venv-pytagi, driven over stdin/stdout.

Protocol: one JSON object per line in, one per line out.
    {"cmd": "init", "data": "<path.npz>", "batch_sizes": [32, 256], "threads": 2, "sigma_v": 0.05,
     "network": "fnn" | "cnn" | "resnet18"}
        -> {"pytagi": "0.2.1", "numpy": "..."}
    {"cmd": "train" | "eval", "batch_size": 32, "num_steps": 128}   -> {"seconds": 0.71}
    {"cmd": "test_error", "batch_size": 32}                          -> {"test_error": 0.02}
    {"cmd": "quit"}
Failures come back as {"error_type": "...", "message": "..."} and the worker keeps serving.
Anything the C++ library prints goes to stderr: the protocol owns stdout.
Needs LD_LIBRARY_PATH to hold nvidia-nccl-cu12's lib folder before Python starts (see
setup_pytagi.sh). Imports nothing from dptrain: that lives in the other venv.
"""

import json
import os
import sys
import time
import traceback

import numpy as np
import pytagi
from pytagi import Utils
from pytagi.nn import (AvgPool2d, BatchNorm2d, Conv2d, LayerBlock, Linear, MixtureReLU,
                       OutputUpdater, ReLU, ResNetBlock, Sequential)

NUM_CLASSES = 10


def resnet18(num_outputs=11, gain=0.083):
    """pytagi's CIFAR-10 ResNet18 on 32x32x3 inputs, with the layer plan of dptrain's
    tagi-resnet18: 3x3 conv (no bias) - MixtureReLU - BatchNorm2d everywhere, the first block
    of stages 2-4 with stride 2, padding_type 2 and a 2x2 stride-2 projection shortcut (conv -
    MixtureReLU - BatchNorm2d), AvgPool2d(4), Linear(512, 11); weight gains 0.083, as on our
    side (with gain 1 the variances of 20 layers grow out of float range)."""

    def conv(cin, cout, k=3, stride=1, padding=1, padding_type=1, **extra):
        return [Conv2d(cin, cout, k, bias=False, stride=stride, padding=padding,
                       padding_type=padding_type, gain_weight=gain, **extra),
                MixtureReLU(), BatchNorm2d(cout)]

    def block(cin, cout, stride):
        pt = 2 if stride == 2 else 1
        main = LayerBlock(*conv(cin, cout, stride=stride, padding_type=pt), *conv(cout, cout))
        if stride == 1 and cin == cout:
            return ResNetBlock(main)
        return ResNetBlock(main, LayerBlock(*conv(cin, cout, k=2, stride=2, padding=0)))

    layers = conv(3, 64, in_width=32, in_height=32)
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        layers += [block(cin, cout, 1 if stage == 0 else 2), block(cout, cout, 1)]
        cin = cout
    return Sequential(*layers, AvgPool2d(4),
                      Linear(512, num_outputs, gain_weight=gain, gain_bias=gain))


def build(network):
    """The benchmark's networks, as pytagi's examples write them (flat inputs: 784 values,
    or 3x32x32 channel-major for the ResNet18)."""
    if network == "resnet18":
        return resnet18()
    if network == "cnn":  # pytagi's MNIST classification CNN
        return Sequential(Conv2d(1, 16, 4, padding=1, in_width=28, in_height=28), ReLU(),
                          AvgPool2d(3, 2), Conv2d(16, 32, 5), ReLU(), AvgPool2d(3, 2),
                          Linear(32 * 4 * 4, 100), ReLU(), Linear(100, 11))
    return Sequential(Linear(784, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 11))


class PytagiBench:
    """One network (FNN 784-128-128-11, the CNN or the ResNet18) per batch size, on a fixed
    data set.

    pytagi sizes its state buffers at the first forward and crashes on a later, larger batch,
    so each batch size gets its own network (the dptrain side does the same, for symmetry).
    """

    def __init__(self, data: str, batch_sizes: list[int], threads: int, sigma_v: float,
                 network: str = "fnn"):
        arrays = np.load(data)
        self.x_train = np.ascontiguousarray(arrays["x_train"], dtype=np.float32)  # (N, 784|3072)
        self.x_test = np.ascontiguousarray(arrays["x_test"], dtype=np.float32)  # (M, 784|3072)
        self.y_test = arrays["y_test"]
        self.utils = Utils()
        obs, idx, self.num_obs = self.utils.label_to_obs(arrays["y_train"], NUM_CLASSES)
        self.obs = obs.astype(np.float32)  # (N * num_obs,) flat, as pytagi takes it
        self.idx = idx.astype(np.int32)  # (N * num_obs,) 1-based output indices
        self.var_obs = np.full_like(self.obs, sigma_v**2)
        self.hrc = self.utils.get_hierarchical_softmax(NUM_CLASSES)
        self.nets = {}
        for batch_size in batch_sizes:
            net = build(network)
            net.set_threads(threads)
            self.nets[batch_size] = (net, OutputUpdater(net.device))
        self.cursor = {b: 0 for b in batch_sizes}

    def train(self, batch_size: int, num_steps: int) -> float:
        """Seconds for num_steps of forward + index update + backward + step."""
        net, updater = self.nets[batch_size]
        n, k = len(self.x_train), self.num_obs
        start = time.perf_counter()
        for _ in range(num_steps):
            i = self.cursor[batch_size]
            self.cursor[batch_size] = (i + batch_size) % n
            net(self.x_train[i : i + batch_size].reshape(-1))
            s = slice(i * k, (i + batch_size) * k)
            updater.update_using_indices(
                net.output_z_buffer, self.obs[s], self.var_obs[s], self.idx[s],
                net.input_delta_z_buffer,
            )
            net.backward()
            net.step()
        return time.perf_counter() - start

    def eval(self, batch_size: int, num_steps: int) -> float:
        """Seconds for num_steps eval-mode forwards, cycling over the test set."""
        net, _ = self.nets[batch_size]
        m = len(self.x_test)
        net.eval()
        start = time.perf_counter()
        for step in range(num_steps):
            i = (step * batch_size) % m
            net(self.x_test[i : i + batch_size].reshape(-1))
        seconds = time.perf_counter() - start
        net.train()
        return seconds

    def test_error(self, batch_size: int) -> float:
        """Classification error on the test set, through pytagi's own HRC decoding."""
        net, _ = self.nets[batch_size]
        net.eval()
        wrong = 0
        for i in range(0, len(self.x_test), batch_size):
            mu, var = net(self.x_test[i : i + batch_size].reshape(-1))
            pred, _ = self.utils.get_labels(mu, var, self.hrc, NUM_CLASSES, batch_size)
            wrong += int(np.sum(pred != self.y_test[i : i + batch_size]))
        net.train()
        return wrong / len(self.x_test)


def handle(bench: PytagiBench | None, msg: dict) -> tuple[PytagiBench | None, dict]:
    cmd = msg["cmd"]
    if cmd == "init":
        bench = PytagiBench(msg["data"], msg["batch_sizes"], msg["threads"], msg["sigma_v"],
                            msg.get("network", "fnn"))
        return bench, {"pytagi": pytagi.__version__.strip(), "numpy": np.__version__}
    if bench is None:
        raise RuntimeError(f"{cmd!r} before 'init'")
    if cmd in ("train", "eval"):
        seconds = getattr(bench, cmd)(msg["batch_size"], msg["num_steps"])
        return bench, {"seconds": seconds}
    if cmd == "test_error":
        return bench, {"test_error": bench.test_error(msg["batch_size"])}
    raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    # Keep the protocol stream private: point fd 1 (where C++ code prints) at stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    bench = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        try:
            bench, reply = handle(bench, msg)
        except Exception as exc:  # report to the parent, which raises with this text
            reply = {"error_type": type(exc).__name__, "message": traceback.format_exc()}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
