"""Goyal et al. 2017's large-batch result (Table 1: linear lr scaling with a gradual warmup
keeps the small batch's accuracy) scaled to this machine, through `dptrain train`.

    .venv/bin/python bench/distributed/large_batch.py                  # 3 seeds, 9 epochs (minutes)
    .venv/bin/python bench/distributed/large_batch.py --seeds 1 --epochs 3 --no-json  # a quick look

writes bench/results/large_batch.json and prints the table the README shows.

Data: "shifted digits", 60,000 training images built without a download: each of the first
1500 of scikit-learn's 8x8 digits, upscaled 3x to 24x24, is placed 40 times in a 28x28 frame at
a random offset (0-4 pixels each way), with a random ink intensity (0.6-1.0) and Gaussian
pixel noise (sd 0.1); the test set is the other 297 digits, 20 times each (5,940 images), in
MNIST's IDX files (`dptrain train --dataset mnist:DIR`). Why: enough samples that 16 x the small
batch (512) still gives 118 steps per epoch, a task on which the small batch ends at a
meaningful error rather than 0 %, and two cores train it in seconds per epoch.

Runs (examples/configs/large_batch_digits.toml and Goyal's Table 1 rows beside it, same
model, data and epochs, SGD with momentum 0.9, weight decay
1e-4 without norms and biases, step decay x 0.1 at epochs 3, 6 and 8 of 9, as Goyal's 30, 60,
80 of 90): batch B = 32 at lr 0.1 x B / 256 (Goyal's rule) with no warmup; batch 16 B = 512 with
the lr scaled linearly (0.2) and a 1-epoch gradual warmup; the same without warmup; and batch
512 at the small batch's lr (no scaling). With fewer epochs the milestones and the warmup
shrink in proportion. Model: torch-mlp (two hidden layers of 256), one
process, one thread. A run whose loss turns non-finite counts as diverged (reported, not
averaged).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import REPO, RESULTS, command_line, cpu_model  # noqa: E402
from common.digit_files import _write_idx  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "large_batch.json"
SMALL, FACTOR, REFERENCE_LR, REFERENCE_BATCH = 32, 16, 0.1, 256
TRAIN_DIGITS, TRAIN_COPIES, TEST_COPIES = 1500, 40, 20

RECIPE = REPO / "examples" / "configs" / "large_batch_digits.toml"
"""The large batch with scaling and warmup; the other rows override some of its options."""
RUNS = {  # name: (global batch, options beyond the recipe's)
    "small batch 32": (SMALL, ["--warmup", "0"]),
    "batch 512, linear scaling + warmup": (SMALL * FACTOR, ["--warmup", "WARMUP"]),
    "batch 512, linear scaling, no warmup": (SMALL * FACTOR, ["--warmup", "0"]),
    "batch 512, no scaling": (SMALL * FACTOR, ["--warmup", "0", "--lr-scaling", "none", "--lr",
                                               str(REFERENCE_LR * SMALL / REFERENCE_BATCH)]),
}


def write_shifted_digits(directory: Path, seed: int = 0) -> Path:
    """MNIST IDX files of the shifted digits (see the module docstring)."""
    digits = load_digits()
    images, labels = digits.images / 16.0, digits.target.astype(np.uint8)
    big = np.kron(images, np.ones((3, 3)))  # (1797, 24, 24)
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for stem, part, copies in (("train", slice(None, TRAIN_DIGITS), TRAIN_COPIES),
                               ("t10k", slice(TRAIN_DIGITS, None), TEST_COPIES)):
        source, tags = np.repeat(big[part], copies, 0), np.repeat(labels[part], copies)
        frames = np.zeros((len(source), 28, 28))
        dy, dx = rng.integers(0, 5, len(source)), rng.integers(0, 5, len(source))
        ink = rng.uniform(0.6, 1.0, len(source))
        for i, image in enumerate(source):
            frames[i, dy[i]:dy[i] + 24, dx[i]:dx[i] + 24] = image * ink[i]
        frames = np.clip(frames + rng.normal(0, 0.1, frames.shape), 0, 1)
        order = rng.permutation(len(frames))
        _write_idx(directory / f"{stem}-images-idx3-ubyte", np.round(frames[order] * 255))
        _write_idx(directory / f"{stem}-labels-idx1-ubyte", tags[order])
    return directory


def train(data: Path, out: Path, batch: int, extra: list[str], seed: int, epochs: int
          ) -> dict:
    """One `dptrain train` run; its summary, or {"diverged": True} for a non-finite loss."""
    milestones = ",".join(str(round(epochs * m / 9, 3)) for m in (3, 6, 8))
    extra = [str(round(epochs / 9, 3)) if a == "WARMUP" else a for a in extra]  # 1 of 9
    cmd = [sys.executable, "-m", "dptrain", "train", "--config", str(RECIPE),
           "--dataset", f"mnist:{data}", "--nproc", "1", "--threads", "1",
           "--epochs", str(epochs), "--batch-size", str(batch), "--seed", str(seed),
           "--milestones", milestones, "--no-progress", "--out", str(out), *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode == 6:  # NonFiniteLoss
        return {"diverged": True, "wall_s": wall}
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    summary = json.loads((out / "summary.json").read_text())
    return {"diverged": False, "test_error": summary["test_error"], "wall_s": wall,
            "peak_lr": summary["config"]["record"]["peak_lr"]}


def table(results: dict[str, list[dict]]) -> str:
    rows = ["| run | global batch | peak lr | test error, mean of seeds (%) | each seed (%) |",
            "|---|---|---|---|---|"]
    for name, runs in results.items():
        errors = [r["test_error"] for r in runs if not r["diverged"]]
        each = ", ".join("diverged" if r["diverged"] else f"{100 * r['test_error']:.2f}"
                         for r in runs)
        mean = f"{100 * statistics.mean(errors):.2f}" if errors else "diverged"
        peak = next((r["peak_lr"] for r in runs if not r["diverged"]), float("nan"))
        rows.append(f"| {name} | {RUNS[name][0]} | {peak:g} | {mean} | {each} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=9)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_shifted_digits(Path(tmp) / "data")
        for seed in range(args.seeds):
            for name, (batch, extra) in RUNS.items():
                run = train(data, Path(tmp) / f"{seed}-{batch}-{len(results[name])}-"
                            f"{abs(hash(name))}", batch, extra, seed, args.epochs)
                results[name].append({"seed": seed, **run})
                print(f"seed {seed}  {name}: " + ("diverged" if run["diverged"] else
                      f"test error {100 * run['test_error']:.2f} %") +
                      f"  ({run['wall_s']:.0f} s)", flush=True)
    shown = table(results)
    print(shown)
    if args.no_json:
        return
    payload = {"command": command_line(), "epochs": args.epochs, "seeds": args.seeds,
               "results": results, "table": shown,
               "hardware": {"cpu_model": cpu_model(), "machine": platform.machine()},
               "torch": torch.__version__}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.output.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(payload, indent=2) + "\n")
    tmp_out.replace(args.output)


if __name__ == "__main__":
    main()
