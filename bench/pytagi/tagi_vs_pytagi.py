"""TAGI throughput, dptrain.tagi vs pytagi 0.2.1, measured side by side in one run.

    .venv/bin/python bench/pytagi/tagi_vs_pytagi.py               # FNN, writes bench/results/*.json
    .venv/bin/python bench/pytagi/tagi_vs_pytagi.py --network cnn       # pytagi's MNIST CNN
    .venv/bin/python bench/pytagi/tagi_vs_pytagi.py --network resnet18  # pytagi's CIFAR-10 ResNet18
    .venv/bin/python bench/pytagi/tagi_vs_pytagi.py --quick             # smoke run, writes nothing
    .venv/bin/python bench/pytagi/tagi_vs_pytagi.py --batch-sizes 32 --compile \
        --output bench/results/tagi_vs_pytagi_b32_compiled.json   # ours as one compiled step

Networks (--network), both with the HRC head (10 classes, 11 outputs, 4 observations per
sample, index-based output update, sigma_v 0.05), on a fixed synthetic MNIST-shaped data set
(no download):
  fnn  784-128-128-11 (Linear-ReLU-Linear-ReLU-Linear)
  cnn  pytagi's MNIST classification CNN on 28x28: Conv2d(1,16,4,padding=1)-ReLU-
       AvgPool2d(3,2)-Conv2d(16,32,5)-ReLU-AvgPool2d(3,2)-Linear(512,100)-ReLU-Linear(100,11);
       also times a torch SGD step (cross-entropy, autograd) on the same network and batch,
       for the ratio of our TAGI step to it
  resnet18  pytagi's CIFAR-10 ResNet18 (the registry's tagi-resnet18, gains 0.083) on
       synthetic 32x32x3 images, batch 32, train only: pytagi takes minutes per step here, so
       a figure is one step, there is no eval phase and no test error (see bench/README.md)
Two measurements per batch size:
  train  forward + update_using_indices + backward + step, per batch
  eval   eval-mode forward
For the FNN a third runner, "matmul", times only the matrix products a TAGI step (or eval
forward) of this network performs, with torch's kernels, the same shapes and layouts and the
same threads, interleaved with the other two: the machine's matmul rate for exactly this work.
Our achieved GFLOP/s (matmul FLOPs of a step from the TAGI equations / our step time) divided
by that rate is the "matmul fraction" (1.0 = every cycle of the step spent in those products).
FLOPs per step, counting 2 per multiply-add, per Linear I -> O and batch B (docs/tagi.md,
Linear):
  forward   m_A m_Wᵀ, m_A² v_Wᵀ, and v_A (m_W² + v_W)ᵀ unless the input is deterministic:
            2 BIO each (the network input is deterministic: 2 products in the first layer)
  backward  δmᵀ m_A and δvᵀ m_A² (weight deltas): 2 BIO each; δm m_W and δv m_W² (input
            innovations): 2 BIO each, not in the first layer
  total     first layer 8 BIO, every other layer 14 BIO; eval: 4 BIO and 6 BIO
  FNN 784-128-128-11: 1,051,904 B FLOP per training step (269 MFLOP at B = 256), 508,160 B
  per eval forward. Elementwise work (O(BI + P)) is not counted: it is the overhead the
  fraction exposes.
Both libraries run on --threads threads (torch.set_num_threads / net.set_threads). Ours runs in
this process; pytagi runs in its own venv (bench/.venv-pytagi, made by setup_pytagi.sh) as the
subprocess _pytagi_worker.py. The two are measured alternately, the first one alternating
between repeats, and each figure is the median over repeats, because the 2-core machine is
shared and noisy. Labels are encoded once up front for both libraries; the timed loop is the
four calls of a TAGI step plus slicing the batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from dptrain import tagi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (PYTAGI_DIR, PYTAGI_VENV, REPO, RESULTS, command_line,  # noqa: E402
                    display_path, git_describe, hardware, setup_pytagi_venv, write_json)

DEFAULT_OUTPUT = RESULTS / "tagi_vs_pytagi.json"
NUM_CLASSES = 10
#: Targets for ours/pytagi per network, phase and batch size (issues 3 and 14: FNN; issue 10:
#: CNN).
TARGETS = {"fnn": {("train", 32): 10.0, ("eval", 32): 10.0, ("train", 256): 8.0,
                   ("eval", 256): 8.0},
           "cnn": {("train", 32): 10.0, ("eval", 32): 5.0, ("train", 256): 10.0,
                   ("eval", 256): 5.0},
           "resnet18": {("train", 32): 10.0}}
#: Targets for our achieved GFLOP/s as a fraction of torch's matmul rate on the same products
#: (issue 14).
MATMUL_TARGETS = {"fnn": {("train", 256): 0.8}}
#: The FNN's Linear layers (inputs, outputs), for the matmul runner and the FLOP count.
FNN_LAYERS = ((784, 128), (128, 128), (128, 11))
NETWORK_NAMES = {
    "fnn": "FNN 784-128-128-11 (Linear-ReLU-Linear-ReLU-Linear)",
    "cnn": "CNN Conv2d(1,16,4,padding=1)-ReLU-AvgPool2d(3,2)-Conv2d(16,32,5)-ReLU-"
           "AvgPool2d(3,2)-Linear(512,100)-ReLU-Linear(100,11), 28x28 inputs",
    "resnet18": "pytagi's CIFAR-10 ResNet18 (3x3 conv-MixtureReLU-BatchNorm2d, 8 ResNet "
                "blocks, AvgPool2d(4), Linear(512,11)), gains 0.083, 32x32x3 inputs",
}
#: Values per sample of each network's input.
INPUT_SIZE = {"fnn": 784, "cnn": 784, "resnet18": 3 * 32 * 32}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS",
                   "KMP_BLOCKTIME", "OPENBLAS_CORETYPE")


class Runner(Protocol):
    """What the measurement loop drives; both libraries implement it."""

    def train(self, batch_size: int, num_steps: int) -> float: ...  # seconds
    def eval(self, batch_size: int, num_steps: int) -> float: ...  # seconds
    def test_error(self, batch_size: int) -> float: ...


# ---------------------------------------------------------------------------------- data
def make_dataset(seed: int, num_train: int, num_test: int, size: int = 784
                 ) -> dict[str, np.ndarray]:
    """MNIST-shaped synthetic digits: 10 fixed random stroke patterns, each sample one of them
    with 20 % of its ink dropped and 5 % salt noise, as uint8 images normalised like MNIST.

    Learnable (both libraries reach a low test error within the timed steps, which the run
    reports as a check that the timed step really trains). x: (N, size) float32 (784 values,
    or 3072 for the 32x32x3 images of the ResNet18), y: (N,) int64.
    """
    rng = np.random.default_rng(seed)
    ink = rng.random((NUM_CLASSES, size)) < 0.19  # about MNIST's share of non-zero pixels
    prototypes = np.where(ink, rng.integers(128, 256, (NUM_CLASSES, size)), 0)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, NUM_CLASSES, n)
        kept = prototypes[labels] * (rng.random((n, size)) < 0.8)
        salt = (rng.random((n, size)) < 0.05) * rng.integers(0, 256, (n, size))
        images = np.maximum(kept, salt).astype(np.uint8)
        x = (images.astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD
        return x.astype(np.float32), labels.astype(np.int64)

    x_train, y_train = draw(num_train)
    x_test, y_test = draw(num_test)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


@contextlib.contextmanager
def tempfile_npz(arrays: dict[str, np.ndarray]) -> Iterator[Path]:
    """The data set as an .npz file, for the pytagi worker (same numbers on both sides)."""
    with tempfile.TemporaryDirectory(prefix="tagi_bench_") as tmp:
        path = Path(tmp) / "data.npz"
        np.savez(path, **arrays)
        yield path


# ---------------------------------------------------------------------------------- ours
def tagi_network(network: str, num_outputs: int) -> tagi.Sequential:
    if network == "resnet18":
        from dptrain.models import ModelOptions, build_model
        return build_model("tagi-resnet18", (3, 32, 32), num_outputs,
                           ModelOptions(gain_weight=0.083, gain_bias=0.083))
    if network == "cnn":
        return tagi.Sequential(
            tagi.Conv2d(1, 16, 4, padding=1, in_width=28, in_height=28), tagi.ReLU(),
            tagi.AvgPool2d(3, 2), tagi.Conv2d(16, 32, 5), tagi.ReLU(), tagi.AvgPool2d(3, 2),
            tagi.Linear(32 * 4 * 4, 100), tagi.ReLU(), tagi.Linear(100, num_outputs))
    return tagi.Sequential(tagi.Linear(784, 128), tagi.ReLU(), tagi.Linear(128, 128),
                           tagi.ReLU(), tagi.Linear(128, num_outputs))


def as_network_input(x: np.ndarray, network: str) -> torch.Tensor:
    """(N, 784) → (N, 784) for the FNN, (N, 1, 28, 28) images for the CNN; (N, 3072) →
    (N, 3, 32, 32) for the ResNet18 (channel-major, as pytagi reads its flat input)."""
    tensor = torch.from_numpy(x)
    shapes = {"cnn": (-1, 1, 28, 28), "resnet18": (-1, 3, 32, 32)}
    return tensor.view(shapes[network]) if network in shapes else tensor


class OursBench:
    """dptrain.tagi in this process; one network per batch size, like the pytagi worker."""

    def __init__(self, data: dict[str, np.ndarray], batch_sizes: list[int], threads: int,
                 sigma_v: float, seed: int, network: str = "fnn", compile: bool = False
                 ) -> None:
        torch.set_num_threads(threads)
        tagi.manual_seed(seed)
        self.x_train = as_network_input(data["x_train"], network)  # (N, 784) or (N, 1, 28, 28)
        self.x_test = as_network_input(data["x_test"], network)
        self.y_test = torch.from_numpy(data["y_test"])  # (M,)
        self.hrc = tagi.HRCSoftmax(num_classes=NUM_CLASSES)
        self.y_obs, self.y_idx = self.hrc.encode(torch.from_numpy(data["y_train"]))  # (N, 4)
        self.var_obs = sigma_v**2  # our API takes a number; pytagi needs a per-observation array
        self.nets = {}
        for batch_size in batch_sizes:
            net = tagi_network(network, self.hrc.num_outputs)
            self.nets[batch_size] = (net, tagi.OutputUpdater(net.device))
        # --compile: each network's step as one compiled program (compiled in the warm-up)
        self.steps = {b: net.compile("indices") for b, (net, _) in self.nets.items()
                      } if compile else {}
        self.cursor = dict.fromkeys(batch_sizes, 0)

    def train(self, batch_size: int, num_steps: int) -> float:
        net, updater = self.nets[batch_size]
        n = len(self.x_train)
        start = time.perf_counter()
        for _ in range(num_steps):
            i = self.cursor[batch_size]
            self.cursor[batch_size] = (i + batch_size) % n
            s = slice(i, i + batch_size)
            if self.steps:
                self.steps[batch_size](self.x_train[s], self.y_obs[s], self.var_obs,
                                       self.y_idx[s])
                continue
            net(self.x_train[s])
            updater.update_using_indices(net.output_z_buffer, self.y_obs[s], self.var_obs,
                                         self.y_idx[s], net.input_delta_z_buffer)
            net.backward()
            net.step()
        return time.perf_counter() - start

    def eval(self, batch_size: int, num_steps: int) -> float:
        net, _ = self.nets[batch_size]
        m = len(self.x_test)
        # --compile: the compiled step's evaluation forward (the native library's, where it
        # steps this network natively)
        forward = self.steps[batch_size].predict if self.steps else net
        net.eval()
        start = time.perf_counter()
        for step in range(num_steps):
            i = (step * batch_size) % m
            forward(self.x_test[i : i + batch_size])
        seconds = time.perf_counter() - start
        net.train()
        return seconds

    def test_error(self, batch_size: int) -> float:
        net, _ = self.nets[batch_size]
        net.eval()
        wrong = 0
        for i in range(0, len(self.x_test), batch_size):
            mu, var = net(self.x_test[i : i + batch_size])
            wrong += int((self.hrc.predict(mu, var) != self.y_test[i : i + batch_size]).sum())
        net.train()
        return wrong / len(self.x_test)


class TorchSGDBench:
    """The same CNN as a torch.nn model trained by plain SGD with autograd: not a TAGI
    competitor, the yardstick for what one step of torch's kernels costs on this network
    (cross-entropy on the 11 outputs; train = zero_grad + forward + backward + step)."""

    def __init__(self, data: dict[str, np.ndarray], batch_sizes: list[int], threads: int,
                 seed: int) -> None:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        nn = torch.nn
        self.x_train = as_network_input(data["x_train"], "cnn")
        self.y_train = torch.from_numpy(data["y_train"])
        self.x_test = as_network_input(data["x_test"], "cnn")
        self.y_test = torch.from_numpy(data["y_test"])
        self.nets = {}
        for batch_size in batch_sizes:
            net = nn.Sequential(nn.Conv2d(1, 16, 4, padding=1), nn.ReLU(), nn.AvgPool2d(3, 2),
                                nn.Conv2d(16, 32, 5), nn.ReLU(), nn.AvgPool2d(3, 2),
                                nn.Flatten(), nn.Linear(512, 100), nn.ReLU(),
                                nn.Linear(100, NUM_CLASSES + 1))
            self.nets[batch_size] = (net, torch.optim.SGD(net.parameters(), lr=0.05))
        self.cursor = dict.fromkeys(batch_sizes, 0)

    def train(self, batch_size: int, num_steps: int) -> float:
        net, opt = self.nets[batch_size]
        n = len(self.x_train)
        start = time.perf_counter()
        for _ in range(num_steps):
            i = self.cursor[batch_size]
            self.cursor[batch_size] = (i + batch_size) % n
            s = slice(i, i + batch_size)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(self.x_train[s]), self.y_train[s]).backward()
            opt.step()
        return time.perf_counter() - start

    def eval(self, batch_size: int, num_steps: int) -> float:
        net, _ = self.nets[batch_size]
        m = len(self.x_test)
        start = time.perf_counter()
        with torch.no_grad():
            for step in range(num_steps):
                i = (step * batch_size) % m
                net(self.x_test[i : i + batch_size])
        return time.perf_counter() - start

    def test_error(self, batch_size: int) -> float:
        net, _ = self.nets[batch_size]
        with torch.no_grad():
            pred = net(self.x_test).argmax(1)
        return float((pred != self.y_test).double().mean())


def linear_flops(layers: tuple[tuple[int, int], ...], batch_size: int, train: bool) -> int:
    """Matmul FLOPs (2 per multiply-add) of one TAGI training step (train) or evaluation
    forward of a Linear stack whose input is deterministic; see the module docstring."""
    total = 0
    for k, (fan_in, fan_out) in enumerate(layers):
        products = (2 if k == 0 else 3) + ((2 if k == 0 else 4) if train else 0)
        total += products * 2 * batch_size * fan_in * fan_out
    return total


class MatmulBench:
    """Only the matrix products of a TAGI step of a Linear stack, as the engine calls them
    (linear.py): per layer addmm(b, m_A, m_Wᵀ), addmm(b, m_A², v_Wᵀ) and, after the first
    layer, addmm_(v_A, (m_W² + v_W)ᵀ); in training also mm(δmᵀ, m_A) and mm(δvᵀ, m_A²) into
    the weight deltas and, after the first layer, mm(δm, m_W) and mm(δv, m_W²). Operands are
    allocated once; their values do not change the time of a product."""

    def __init__(self, layers: tuple[tuple[int, int], ...], batch_sizes: list[int],
                 threads: int, seed: int) -> None:
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(seed)
        self.layers = layers
        self.weights = [(torch.randn(o, i, generator=gen), torch.rand(o, i, generator=gen),
                         torch.rand(o, generator=gen)) for i, o in layers]
        self.deltas = [(torch.empty(o, i), torch.empty(o, i)) for i, o in layers]
        self.states = {b: [(torch.randn(b, i, generator=gen), torch.rand(b, i, generator=gen),
                            torch.randn(b, o, generator=gen), torch.empty(b, o))
                           for i, o in layers] for b in batch_sizes}

    def _products(self, batch_size: int, train: bool) -> None:
        for k, ((w, v, b), (dw_mu, dw_var), (a, a_var, d, z)) in enumerate(
                zip(self.weights, self.deltas, self.states[batch_size])):
            torch.addmm(b, a, w.t())
            torch.addmm(b, a, v.t(), out=z)
            if k:
                z.addmm_(a_var, v.t())
            if train:
                torch.mm(d.t(), a, out=dw_mu)
                torch.mm(d.t(), a_var, out=dw_var)
                if k:
                    torch.mm(d, w)
                    torch.mm(d, v)

    def _time(self, batch_size: int, num_steps: int, train: bool) -> float:
        start = time.perf_counter()
        for _ in range(num_steps):
            self._products(batch_size, train)
        return time.perf_counter() - start

    def train(self, batch_size: int, num_steps: int) -> float:
        return self._time(batch_size, num_steps, True)

    def eval(self, batch_size: int, num_steps: int) -> float:
        return self._time(batch_size, num_steps, False)

    def test_error(self, batch_size: int) -> float:
        return float("nan")  # nothing is learned: the products only


# ---------------------------------------------------------------------------------- pytagi
class PytagiWorker:
    """_pytagi_worker.py in bench/.venv-pytagi, one JSON request/reply per line."""

    def __init__(self, python: Path) -> None:
        nccl_libs = sorted(PYTAGI_VENV.glob("lib/python*/site-packages/nvidia/nccl/lib"))
        if not nccl_libs:
            raise RuntimeError(f"no nvidia/nccl/lib under {PYTAGI_VENV}; rerun setup_pytagi.sh")
        env = dict(os.environ)
        # The loader reads LD_LIBRARY_PATH at process start, so it is set for the child here.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(nccl_libs[-1])] + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
        self.proc = subprocess.Popen([str(python), str(PYTAGI_DIR / "_pytagi_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)

    def request(self, **msg: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"pytagi worker died during {msg['cmd']!r} (exit code {code})")
        reply = json.loads(line)
        if "error_type" in reply:
            raise RuntimeError(f"pytagi worker failed on {msg}:\n{reply['message']}")
        return reply

    def train(self, batch_size: int, num_steps: int) -> float:
        return self.request(cmd="train", batch_size=batch_size, num_steps=num_steps)["seconds"]

    def eval(self, batch_size: int, num_steps: int) -> float:
        return self.request(cmd="eval", batch_size=batch_size, num_steps=num_steps)["seconds"]

    def test_error(self, batch_size: int) -> float:
        return self.request(cmd="test_error", batch_size=batch_size)["test_error"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


# ---------------------------------------------------------------------------------- measuring
PHASES = ("train", "eval")


def measure(runners: dict[str, Runner], args: argparse.Namespace) -> dict:
    """samples/s of every (phase, batch size, library), one figure per repeat.

    Within a repeat the libraries take turns on each (batch size, phase), and which one goes
    first alternates between repeats, so slow drift in the machine's load hits both alike.
    """
    phases = PHASES if args.network != "resnet18" else ("train",)  # pytagi: minutes per step
    rates = {(phase, b): {lib: [] for lib in runners} for phase in phases for b in args.batch_sizes}
    for b in args.batch_sizes:  # first-call allocations and caches, untimed
        for lib, runner in runners.items():
            # A pytagi ResNet18 step takes minutes, which its first-call allocations do not
            # change: warming it up would only double the run.
            if lib == "pytagi" and args.network == "resnet18":
                continue
            for phase in phases:
                getattr(runner, phase)(b, args.warmup_steps)
    libs = list(runners)
    for rep in range(args.repeats):
        order = libs if rep % 2 == 0 else libs[::-1]
        for b in args.batch_sizes:
            for phase in phases:
                num_samples = args.train_samples if phase == "train" else args.eval_samples
                num_steps = max(1, num_samples // b)
                for lib in order:
                    seconds = getattr(runners[lib], phase)(b, num_steps)
                    rates[(phase, b)][lib].append(num_steps * b / seconds)
        done = "  ".join(f"{phase} b{b} {r['ours'][-1] / r['pytagi'][-1]:.1f}x"
                         for (phase, b), r in rates.items())
        if "matmul" in libs:
            done += "  (matmul fraction: " + "  ".join(
                f"{phase} b{b} {r['ours'][-1] / r['matmul'][-1]:.0%}"
                for (phase, b), r in rates.items()) + ")"
        if "torch" in libs:
            done += "  (train step time ours/torch SGD: " + "  ".join(
                f"b{b} {rates[('train', b)]['torch'][-1] / rates[('train', b)]['ours'][-1]:.2f}"
                for b in args.batch_sizes) + ")"
        print(f"repeat {rep + 1}/{args.repeats} (ours/pytagi): {done}", flush=True)
    return rates


def summarize(rates: dict, errors: dict, network: str = "fnn") -> list[dict]:
    """One row per (phase, batch size): medians and their ratio (the headline figure), the
    median of the per-repeat ratios, and the best repeats; with a torch runner also its
    samples/s and `torch_time_ratio` = our step time / torch's (median of per-repeat ratios)."""
    rows = []
    for (phase, b), by_lib in rates.items():
        ours, ref = by_lib["ours"], by_lib["pytagi"]
        ratio = statistics.median(ours) / statistics.median(ref)
        target = TARGETS[network].get((phase, b))
        torch_columns = {}
        if "torch" in by_lib:
            torch_rates = by_lib["torch"]
            torch_columns = {
                "torch_sgd_samples_per_s": statistics.median(torch_rates),
                "torch_time_ratio": statistics.median(t / o for o, t in zip(ours, torch_rates)),
                "torch_runs": torch_rates, "torch_test_error": errors[b].get("torch")}
        matmul_columns = {}
        if "matmul" in by_lib:
            flops = linear_flops(FNN_LAYERS, b, phase == "train") / b  # per sample
            matmul_rates = by_lib["matmul"]
            fraction = statistics.median(ours) / statistics.median(matmul_rates)
            matmul_target = MATMUL_TARGETS.get(network, {}).get((phase, b))
            matmul_columns = {
                "matmul_flops_per_sample": flops,
                "ours_gflops": statistics.median(ours) * flops / 1e9,
                "matmul_gflops": statistics.median(matmul_rates) * flops / 1e9,
                "matmul_fraction": fraction,
                "matmul_fraction_paired_median": statistics.median(
                    o / m for o, m in zip(ours, matmul_rates)),
                "matmul_fraction_target": matmul_target,
                "meets_matmul_target": None if matmul_target is None else
                fraction >= matmul_target,
                "matmul_runs": matmul_rates}
        rows.append(torch_columns | matmul_columns | {
            "phase": phase, "batch_size": b,
            "ours_samples_per_s": statistics.median(ours),
            "pytagi_samples_per_s": statistics.median(ref),
            "ratio": ratio,
            "paired_ratio_median": statistics.median(o / r for o, r in zip(ours, ref)),
            # The least-disturbed repeat of each: closest to an idle machine's figure.
            "ours_best_samples_per_s": max(ours), "pytagi_best_samples_per_s": max(ref),
            "ratio_of_best": max(ours) / max(ref),
            "target_ratio": target,
            "meets_target": None if target is None else ratio >= target,
            "ours_runs": ours, "pytagi_runs": ref,
            "ours_test_error": errors[b].get("ours"), "pytagi_test_error": errors[b].get("pytagi"),
        })
    return sorted(rows, key=lambda r: (PHASES.index(r["phase"]), r["batch_size"]))


def _rate(samples_per_s: float) -> str:
    """Whole samples/s, or two decimals for the ResNet18's few samples/s."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.2f}"


def format_table(rows: list[dict]) -> str:
    with_torch = "torch_sgd_samples_per_s" in rows[0]
    with_matmul = "matmul_fraction" in rows[0]
    extra = f"{'torch SGD/s':>13}{'ours/torch time':>17}" if with_torch else ""
    if with_matmul:
        extra += f"{'GFLOP/s':>9}{'matmul GFLOP/s':>16}{'fraction':>10}{'target':>12}"
    lines = [f"{'phase':<6}{'batch':>6}{'dptrain.tagi/s':>16}{'pytagi/s':>11}{'ratio':>8}"
             f"{'target':>12}{'best ratio':>12}" + extra]
    for r in rows:
        target = "" if r["target_ratio"] is None else (
            f">={r['target_ratio']:g}x " + ("ok" if r["meets_target"] else "MISS"))
        line = (f"{r['phase']:<6}{r['batch_size']:>6}{_rate(r['ours_samples_per_s']):>16}"
                f"{_rate(r['pytagi_samples_per_s']):>11}{r['ratio']:>7.2f}x{target:>12}"
                f"{r['ratio_of_best']:>11.2f}x")
        if with_torch:
            line += f"{r['torch_sgd_samples_per_s']:>13,.0f}{r['torch_time_ratio']:>16.2f}x"
        if with_matmul:
            goal = r["matmul_fraction_target"]
            goal = "" if goal is None else (
                f">={goal:.0%} " + ("ok" if r["meets_matmul_target"] else "MISS"))
            line += (f"{r['ours_gflops']:>9.1f}{r['matmul_gflops']:>16.1f}"
                     f"{r['matmul_fraction']:>10.0%}{goal:>12}")
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", choices=sorted(NETWORK_NAMES), default="fnn")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved repeats (median taken; default 7 fnn, 5 cnn)")
    p.add_argument("--train-samples", type=int, default=None,
                   help="samples per train figure (default 4096 fnn, 1024 cnn, 32 resnet18)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="samples per eval figure (default 8192 fnn, 2048 cnn)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed steps per runner first (default 8, 1 for resnet18)")
    p.add_argument("--threads", type=int, default=2, help="threads for each library")
    p.add_argument("--sigma-v", type=float, default=0.05, help="observation noise std")
    p.add_argument("--compile", action="store_true",
                   help="train ours with net.compile() (compiled in the untimed warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 3 repeats of fewer samples; writes no JSON unless --output")
    p.add_argument("--output", type=Path, default=None,
                   help=f"JSON results (default {DEFAULT_OUTPUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    # pytagi trains the CNN at ~100-140 samples/s here, the ResNet18 at 0.2-0.35 samples/s (one
    # batch-32 step takes minutes): fewer samples keep a run to minutes.
    defaults = {"fnn": (7, 4096, 8192), "cnn": (5, 1024, 2048), "resnet18": (3, 32, 0)}
    quick = {"fnn": (3, 1024, 2048), "cnn": (2, 256, 512), "resnet18": (1, 32, 0)}
    defaults = (quick if args.quick else defaults)[args.network]
    if args.network == "resnet18":
        if args.batch_sizes == [32, 256]:
            args.batch_sizes = [32]
        if args.warmup_steps is None:
            args.warmup_steps = 1
    for name, value in zip(("repeats", "train_samples", "eval_samples", "warmup_steps"),
                           (*defaults, 8)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not args.quick and args.output is None:
        args.output = (DEFAULT_OUTPUT if args.network == "fnn" else
                       DEFAULT_OUTPUT.with_name(f"tagi_vs_pytagi_{args.network}.json"))
    if min(args.batch_sizes) < 2 or args.repeats < 1 or args.threads < 1:
        p.error("batch sizes must be >= 2, repeats and threads >= 1")
    return args


def run(args: argparse.Namespace, data: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """(samples/s per repeat, test errors, pytagi's versions), the worker closed whatever
    happens."""
    worker = PytagiWorker(setup_pytagi_venv())
    try:
        with tempfile_npz(data) as path:
            versions = worker.request(cmd="init", data=str(path), batch_sizes=args.batch_sizes,
                                      threads=args.threads, sigma_v=args.sigma_v,
                                      network=args.network)
        ours = OursBench(data, args.batch_sizes, args.threads, args.sigma_v, args.seed,
                         args.network, args.compile)
        runners: dict[str, Runner] = {"ours": ours, "pytagi": worker}
        if args.network == "cnn":
            runners["torch"] = TorchSGDBench(data, args.batch_sizes, args.threads, args.seed)
        if args.network == "fnn":
            runners["matmul"] = MatmulBench(FNN_LAYERS, args.batch_sizes, args.threads,
                                            args.seed)
        print(f"dptrain.tagi (torch {torch.__version__}) vs pytagi {versions['pytagi']}, "
              f"{args.threads} threads each, {args.repeats} interleaved repeats", flush=True)
        rates = measure(runners, args)
        # A pass over the test set would take pytagi an hour on the ResNet18: no check there.
        errors = {b: ({} if args.network == "resnet18" else
                      {lib: r.test_error(b) for lib, r in runners.items()
                       if lib != "matmul"})
                  for b in args.batch_sizes}
    finally:
        worker.close()
    return rates, errors, versions


def report(args: argparse.Namespace, rows: list[dict], versions: dict,
           load_before: tuple[float, ...]) -> dict:
    """The JSON document: what ran where, and the rows."""
    return {
        "benchmark": "tagi_vs_pytagi",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(THREAD_ENV_VARS),
        "git": git_describe(),
        "hardware": hardware(),
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads(), "numpy": np.__version__,
                     "pytagi": versions["pytagi"], "pytagi_numpy": versions["numpy"]},
        # Threading knobs change torch's figures a lot on a shared machine (see README).
        "environment": {k: os.environ.get(k) for k in THREAD_ENV_VARS},
        "settings": {k: (display_path(v) if isinstance(v, Path) else v)
                     for k, v in vars(args).items()}
                    | {"network": NETWORK_NAMES[args.network],
                       "head": "HRC, 10 classes, 11 outputs, 4 observations/sample",
                       "data": ("synthetic 32x32x3 images, 512 train, fixed seed"
                                if args.network == "resnet18" else
                                "synthetic MNIST-shaped, 8192 train / 2048 test, fixed seed")},
        "results": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    size = INPUT_SIZE[args.network]
    data = (make_dataset(args.seed, num_train=512, num_test=64, size=size)
            if args.network == "resnet18" else make_dataset(args.seed, 8192, 2048, size))
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"warning: 1-minute load average {load_before[0]:.2f} before starting: other "
              "processes share the cores, so expect low and noisy figures", flush=True)
    rates, errors, versions = run(args, data)
    rows = summarize(rates, errors, args.network)
    print("\nsamples/s, median over repeats; ratio = ours/pytagi of the medians; best ratio = "
          "of each library's fastest repeat")
    if args.network == "fnn":
        print("GFLOP/s = matmul FLOPs of the TAGI step (see the script's docstring) / our time; "
              "matmul GFLOP/s = torch's rate on exactly those products, measured alongside; "
              "fraction = the two's ratio")
    print(format_table(rows))
    if any(errors.values()):
        print("test error after the timed steps (check that both really train): " + ", ".join(
            f"b{b} " + " ".join(f"{lib} {err:.1%}" for lib, err in e.items())
            for b, e in errors.items()))
    if args.output is not None:
        write_json(args.output, report(args, rows, versions, load_before))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
