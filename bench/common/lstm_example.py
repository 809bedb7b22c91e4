"""pytagi 0.2.1's LSTM forecasting example, as it ships: its data, our network and the two
libraries' training runs, shared by pytagi/tagi_lstm_vs_pytagi.py (the comparison, where the
example is described) and pytagi/tagi_lstm_init_swap.py (the initial draws swapped).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dptrain import tagi

from . import PYTAGI_DIR, PYTAGI_VENV
from .gaussian_forecasts import gaussian_scores

WINDOW, TRAIN_DAYS, TEST_DAYS = 5, 924, 232
SIGMA_V = (1.0, 0.3, 0.99)  # start, floor, decay per epoch (pytagi's exponential_scheduler)
#: CPU seconds (this process's, or the worker's) of each run's timed training, per library, in
#: run order: on a shared machine wall time also counts the time other work held the core
CPU_SECONDS: dict[str, list[float]] = {"dptrain": [], "pytagi": []}
#: with --compile: seconds of the steps that may compile, of each run (the second step; the
#: first after the first reset of the LSTM states)
COMPILE_SECONDS: list[float] = []


def sine_series() -> np.ndarray:
    """pytagi's toy series, one value per day from 2019-01-01 (train days, then test days)."""
    start = np.datetime64("2019-01-01")
    days = np.arange(start, start + TRAIN_DAYS + TEST_DAYS, dtype="datetime64[D]")
    seconds = days.astype("datetime64[s]").astype(np.int64)
    return 5.0 * (1.0 + np.sin(seconds * (2.0 * np.pi / (365.24 * 24 * 60 * 60))))


def windows(series: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, WINDOW) inputs and (N, 1) next values, stride 1."""
    x = np.lib.stride_tricks.sliding_window_view(series[:-1], WINDOW)
    return x.copy(), series[WINDOW:, None].copy()


def make_data(epochs: int, batch_size: int) -> dict[str, np.ndarray]:
    series = sine_series()
    train, test = series[:TRAIN_DAYS], series[TRAIN_DAYS:]
    mean, std = train.mean(), train.std()
    x_train, y_train = windows((train - mean) / std)
    x_test, y_test = windows((test - mean) / std)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test,
            "mean": np.array(mean), "std": np.array(std), "batch_size": np.array(batch_size),
            "epochs": np.array(epochs), "sigma_v": np.array(SIGMA_V)}


def sigma_v_at(epoch: int, current: float) -> float:
    """pytagi's exponential_scheduler as its example calls it: on the previous epoch's value,
    so the decay compounds (σ_v after epoch e is 0.99^(0+1+…+e), floored at 0.3)."""
    _, floor, decay = SIGMA_V
    return max(current * decay**epoch, floor)


def build_ours(seed: int, dtype: torch.dtype = torch.float32) -> tagi.Sequential:
    tagi.manual_seed(seed)
    return tagi.Sequential(tagi.LSTM(1, 8, WINDOW), tagi.LSTM(8, 8, WINDOW),
                           tagi.Linear(8 * WINDOW, 1), dtype=dtype)


def run_ours(data: dict[str, np.ndarray], seed: int, init: dict[str, np.ndarray] | None = None,
             dtype: torch.dtype = torch.float32, compile: bool = False,
             ) -> tuple[np.ndarray, np.ndarray, float]:
    """`init`: start from these parameters (state_dict keys) instead of our own draws.
    `compile`: train with `net.compile()`; the steps that may compile are left out of the
    time: the first two (for inductor's program an eager step, then tracing and code
    generation; the native step, which this network takes, builds or loads its library in
    the first) and the first after the first reset of the LSTM states (inductor compiles a
    second variant there), the last two recorded in `COMPILE_SECONDS`."""
    torch.set_num_threads(1)
    net = build_ours(seed, dtype)
    if init is not None:
        state = net.state_dict()
        state.update({key: torch.from_numpy(np.asarray(value)).reshape(state[key].shape)
                      .to(dtype) for key, value in init.items()})
        net.load_state_dict(state)
    updater = tagi.OutputUpdater(net.device)
    x_train = torch.from_numpy(data["x_train"]).to(dtype)
    y_train = torch.from_numpy(data["y_train"]).to(dtype)
    x_test = torch.from_numpy(data["x_test"]).to(dtype)
    batch, sigma_v = int(data["batch_size"]), SIGMA_V[0]
    step = net.compile() if compile else None
    compiling = cpu_compiling = 0.0  # of the steps left out of the rate
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(int(data["epochs"])):
        sigma_v = sigma_v_at(epoch, sigma_v)
        for i in range(0, len(x_train) - batch + 1, batch):
            if step is not None:
                # the first two steps (eager, then compiling) and the first step after the
                # first reset of the LSTM states (a second program: no carried states yet);
                # only these are timed on their own, the clocks' own cost kept off the others
                if (epoch == 0 and i <= batch) or (epoch == 1 and i == 0):
                    began, cpu_began = time.perf_counter(), time.process_time()
                    step(x_train[i:i + batch], y_train[i:i + batch], sigma_v**2)
                    compiling += time.perf_counter() - began
                    cpu_compiling += time.process_time() - cpu_began
                    if i != 0 or epoch == 1:
                        COMPILE_SECONDS.append(time.perf_counter() - began)
                else:
                    step(x_train[i:i + batch], y_train[i:i + batch], sigma_v**2)
                continue
            net(x_train[i:i + batch])
            updater.update(net.output_z_buffer, y_train[i:i + batch], sigma_v**2,
                           net.input_delta_z_buffer)
            net.backward()
            net.step()
        net.reset_lstm_states()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if step is not None:
        assert step.fallback_reason is None, step.fallback_reason
        steps = step.compiled_steps + step.eager_steps
        scale = steps / (steps - 2 - (int(data["epochs"]) > 1))
        seconds, cpu_seconds = (seconds - compiling) * scale, (cpu_seconds - cpu_compiling) * scale
    CPU_SECONDS["dptrain"].append(cpu_seconds)
    mus, variances = [], []
    batch = min(batch, len(x_test))  # (a batch larger than the test part: one batch of it)
    for i in range(0, len(x_test) - batch + 1, batch):
        mu, var = net(x_test[i:i + batch])
        mus.append(mu.reshape(-1).numpy())
        variances.append(var.reshape(-1).numpy() + sigma_v**2)
    return np.concatenate(mus), np.concatenate(variances), seconds


def run_pytagi(python: Path, data_file: Path, seed: int, **options: str
               ) -> tuple[np.ndarray, np.ndarray, float]:
    """`options`: the worker's optional keys ("init", "init_out": .npz paths)."""
    nccl_libs = sorted(PYTAGI_VENV.glob("lib/python*/site-packages/nvidia/nccl/lib"))
    env = {"LD_LIBRARY_PATH": str(nccl_libs[-1]), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.npz"
        args = json.dumps({"data": str(data_file), "out": str(out), "seed": seed, "threads": 1,
                           **options})
        subprocess.run([str(python), str(PYTAGI_DIR / "_pytagi_lstm_worker.py"), args],
                       check=True, env=env, timeout=1800)
        result = np.load(out)
        CPU_SECONDS["pytagi"].append(float(result["cpu_seconds"]))
        return result["mu"], result["var"], float(result["seconds"])


def metrics(mu: np.ndarray, var: np.ndarray, data: dict[str, np.ndarray]) -> dict[str, float]:
    """In the series' units, over the test windows both libraries predicted."""
    std, mean = float(data["std"]), float(data["mean"])
    y = data["y_test"][: len(mu), 0] * std + mean
    return gaussian_scores(y, mu * std + mean, var * std**2)
