"""Heteroscedastic TAGI regression, dptrain.tagi vs pytagi 0.2.1, side by side in one run.

    .venv/bin/python bench/pytagi/tagi_heteros_vs_pytagi.py            # writes bench/results/*.json
    .venv/bin/python bench/pytagi/tagi_heteros_vs_pytagi.py --quick    # smoke run, writes nothing

pytagi's regression_heteros protocol (1 input, two hidden ReLU layers of 128, Linear(128, 2),
EvenExp, update_heteros, batch 10, 50 epochs) on dptrain's toy1d-hetero data (500 training
points, noise standard deviation 0.1 + 0.5|x|), both libraries visiting the same samples in the
same order, float32, one thread each. Per seed the two runs alternate (which goes first
alternates too); reported: test RMSE, mean log-likelihood per point and 2σ coverage in the data's
units (computed here, the same way for both), and training samples/s (median over seeds), per
second of wall clock and per CPU second of the training process (on a shared machine wall time
also counts the time other work held the core).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dptrain.data import load_toy1d_hetero
from dptrain.tagi import EvenExp, Linear, OutputUpdater, ReLU, Sequential, manual_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (PYTAGI_DIR, PYTAGI_VENV, RESULTS, command_line,  # noqa: E402
                    git_describe, hardware, setup_pytagi_venv, write_json)
from common.gaussian_forecasts import gaussian_scores, print_table, summarize  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_heteros_vs_pytagi.json"
#: The issue's targets: log-likelihood at least pytagi's, samples/s at least 2x.
SPEED_TARGET = 2.0


def make_data(epochs: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    split = load_toy1d_hetero(seed=0)
    order_rng = np.random.default_rng(seed)
    n = len(split.train)
    return {"x_train": split.train.x.numpy(), "y_train": split.train.y.numpy(),
            "x_test": split.test.x.numpy(), "y_test": split.test.y.numpy(),
            "y_mean": split.y_norm.mean.numpy(), "y_std": split.y_norm.std.numpy(),
            "orders": np.stack([order_rng.permutation(n) for _ in range(epochs)]),
            "batch_size": np.array(batch_size)}


#: with --compile: seconds of the first two steps of each run (eager, then compiling)
COMPILE_SECONDS: list[float] = []
#: CPU seconds (this process's, or the worker's) of each run's timed training, per library, in
#: run order: on a shared machine wall time also counts the time other work held the core
CPU_SECONDS: dict[str, list[float]] = {"dptrain": [], "pytagi": []}


def run_ours(data: dict[str, np.ndarray], seed: int, compile: bool = False
             ) -> tuple[np.ndarray, np.ndarray, float]:
    """`compile`: train with `net.compile("heteros")`; its first two steps (eager, then
    compiling) are left out of the time and recorded in `COMPILE_SECONDS`."""
    torch.set_num_threads(1)
    manual_seed(seed)
    net = Sequential(Linear(1, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 2), EvenExp())
    updater = OutputUpdater()
    x_train, y_train = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    batch = int(data["batch_size"])
    step = net.compile("heteros") if compile else None
    start, cpu_start = time.perf_counter(), time.process_time()
    for order in torch.from_numpy(data["orders"]):
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            if step is not None:
                step(x_train[idx], y_train[idx])
                if step.compiled_steps + step.eager_steps == 2:
                    COMPILE_SECONDS.append(time.perf_counter() - start)
                    start, cpu_start = time.perf_counter(), time.process_time()
                continue
            net(x_train[idx])
            updater.update_heteros(net.output_z_buffer, y_train[idx], net.input_delta_z_buffer)
            net.backward()
            net.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if step is not None:
        assert step.fallback_reason is None, step.fallback_reason
        done = step.compiled_steps + step.eager_steps
        seconds *= done / (done - 2)
        cpu_seconds *= done / (done - 2)
    CPU_SECONDS["dptrain"].append(cpu_seconds)
    net.eval()
    mu, var = net(torch.from_numpy(data["x_test"]))
    return mu.numpy(), var.numpy(), seconds


def run_pytagi(python: Path, data_file: Path, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    nccl_libs = sorted(PYTAGI_VENV.glob("lib/python*/site-packages/nvidia/nccl/lib"))
    env = {"LD_LIBRARY_PATH": str(nccl_libs[-1]), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.npz"
        args = json.dumps({"data": str(data_file), "out": str(out), "seed": seed, "threads": 1})
        subprocess.run([str(python), str(PYTAGI_DIR / "_pytagi_heteros_worker.py"), args],
                       check=True, env=env, timeout=1800)
        result = np.load(out)
        CPU_SECONDS["pytagi"].append(float(result["cpu_seconds"]))
        return result["mu"], result["var"], float(result["seconds"])


def metrics(mu: np.ndarray, var: np.ndarray, data: dict[str, np.ndarray]) -> dict[str, float]:
    """In the data's units: the predictive variance is the mean's plus the expected noise."""
    scale, shift = float(data["y_std"].reshape(-1)[0]), float(data["y_mean"].reshape(-1)[0])
    mean = mu[:, 0] * scale + shift
    total_var = (var[:, 0] + mu[:, 1]) * scale**2
    y = data["y_test"][:, 0] * scale + shift
    return gaussian_scores(y, mean, total_var)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="1 seed, 2 epochs; writes nothing")
    p.add_argument("--compile", action="store_true",
                   help="train ours with net.compile(); samples/s then leaves out the first "
                        "two steps (eager, compiling), reported as compile_seconds")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 1, 2
    python = setup_pytagi_venv()
    rows = {"dptrain": [], "pytagi": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            data = make_data(args.epochs, args.batch_size, seed)
            data_file = Path(tmp) / f"data{seed}.npz"
            np.savez(data_file, **data)
            samples = args.epochs * (len(data["x_train"]) // args.batch_size) * args.batch_size
            runs = [("dptrain", lambda: run_ours(data, seed, args.compile)),
                    ("pytagi", lambda: run_pytagi(python, data_file, seed))]
            for name, fn in (runs if seed % 2 == 0 else runs[::-1]):
                mu, var, seconds = fn()
                rows[name].append({**metrics(mu, var, data), "samples_per_s": samples / seconds,
                                   "cpu_samples_per_s": samples / CPU_SECONDS[name][-1]})
    summary = summarize(rows)
    speedup = summary["dptrain"]["samples_per_s"] / summary["pytagi"]["samples_per_s"]
    cpu_speedup = (summary["dptrain"]["cpu_samples_per_s"] /
                   summary["pytagi"]["cpu_samples_per_s"])
    print_table(summary)
    ll_ok = summary["dptrain"]["log_likelihood"] >= summary["pytagi"]["log_likelihood"]
    print(f"speed ratio dptrain/pytagi {speedup:.2f}x (target >= {SPEED_TARGET}x: "
          f"{'met' if speedup >= SPEED_TARGET else 'NOT met'}); log-likelihood "
          f"{'>=' if ll_ok else '<'} pytagi's; per CPU second {cpu_speedup:.2f}x")
    if not args.quick:
        write_json(args.output, {"command": command_line(), "seeds": args.seeds,
                                 "compiled": args.compile, "compile_seconds": COMPILE_SECONDS,
                                 "epochs": args.epochs, "batch_size": args.batch_size,
                                 "per_seed": rows, "summary": summary, "speed_ratio": speedup,
                                 "cpu_speed_ratio": cpu_speedup,
                                 "load_average_1_5_15": os.getloadavg(),
                                 "hardware": hardware(), "git": git_describe(),
                                 "torch": torch.__version__})


if __name__ == "__main__":
    main()
