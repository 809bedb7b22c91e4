"""The digits learning protocol (tests/unit/tagi/test_learning.py) run by pytagi 0.2.1 and by
dptrain.tagi on the same data in the same order: the reference test errors the README quotes.

    .venv/bin/python bench/pytagi/pytagi_digits_reference.py          # ~1 min; writes the JSON
    .venv/bin/python bench/pytagi/pytagi_digits_reference.py --quick  # 1 seed, 1 epoch; no JSON

writes bench/results/pytagi_digits_reference.json.

Protocol, as in the test: the built-in digits (sklearn's, split 1437 / 360 stratified with
random_state 0, pixels / 16 minus the training mean), HRC head (10 classes, 11 outputs,
σ_v = 0.05), batch 32 (each epoch's last batch 29), 10 epochs, one permutation per epoch from
`numpy.random.default_rng(seed)`, float32, one thread. Networks: the FNN 64-128-128-11
(seeds 0, 1, 2) and the 8x8 CNN Conv2d(1,16,3,padding=1)-ReLU-AvgPool2d(2)-
Conv2d(16,32,3,padding=1)-ReLU-AvgPool2d(2)-Linear(128,64)-ReLU-Linear(64,11) (seeds 0-5).
Each library draws its own initial parameters from the seed (pytagi.manual_seed,
dptrain.tagi.manual_seed), so the two are the same protocol, not the same network; pytagi's
errors are decoded by its own HRC utilities. pytagi runs in bench/.venv-pytagi
(`_pytagi_digits_worker.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dptrain.data import load_digits
from dptrain.tagi import (AvgPool2d, Conv2d, HRCSoftmax, Linear, OutputUpdater, ReLU, Sequential,
                          manual_seed)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (PYTAGI_DIR, PYTAGI_VENV, RESULTS, command_line,  # noqa: E402
                    git_describe, hardware, setup_pytagi_venv, write_json)

DEFAULT_OUTPUT = RESULTS / "pytagi_digits_reference.json"
SEEDS = {"fnn": 3, "cnn": 6}
EPOCHS, BATCH, SIGMA_V = 10, 32, 0.05


def build_ours(network: str) -> Sequential:
    if network == "fnn":
        return Sequential(Linear(64, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 11))
    return Sequential(Conv2d(1, 16, 3, padding=1), ReLU(), AvgPool2d(2),
                      Conv2d(16, 32, 3, padding=1), ReLU(), AvgPool2d(2),
                      Linear(128, 64), ReLU(), Linear(64, 11))


def make_data(network: str, seed: int, epochs: int) -> dict[str, np.ndarray]:
    split = load_digits(flat=network == "fnn")
    order_rng = np.random.default_rng(seed)
    n = len(split.train)
    return {"x_train": split.train.x.numpy(), "y_train": split.train.y.numpy(),
            "x_test": split.test.x.numpy(), "y_test": split.test.y.numpy(),
            "orders": np.stack([order_rng.permutation(n) for _ in range(epochs)]),
            "batch_size": np.array(BATCH), "sigma_v": np.array(SIGMA_V)}


def run_ours(network: str, data: dict[str, np.ndarray], seed: int) -> dict:
    """The test's loop (tests/unit/tagi/test_learning.py, _digits_error)."""
    torch.set_num_threads(1)
    manual_seed(seed)
    net = build_ours(network)
    hrc, updater = HRCSoftmax(num_classes=10), OutputUpdater(net.device)
    x_train, y_train = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    start = time.perf_counter()
    for order in torch.from_numpy(data["orders"]):
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            net(x_train[idx])
            y_obs, y_idx = hrc.encode(y_train[idx])
            updater.update_using_indices(net.output_z_buffer, y_obs, SIGMA_V**2, y_idx,
                                         net.input_delta_z_buffer)
            net.backward()
            net.step()
    seconds = time.perf_counter() - start
    net.eval()
    mu, var = net(torch.from_numpy(data["x_test"]))
    wrong = int((hrc.predict(mu, var) != torch.from_numpy(data["y_test"])).sum())
    return {"test_error": wrong / len(data["y_test"]), "wrong": wrong, "seconds": seconds}


def run_pytagi(python: Path, network: str, data_file: Path, seed: int) -> dict:
    nccl_libs = sorted(PYTAGI_VENV.glob("lib/python*/site-packages/nvidia/nccl/lib"))
    env = {"LD_LIBRARY_PATH": str(nccl_libs[-1]), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    args = json.dumps({"data": str(data_file), "network": network, "seed": seed, "threads": 1})
    out = subprocess.run([str(python), str(PYTAGI_DIR / "_pytagi_digits_worker.py"), args],
                         check=True, env=env, timeout=1800, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 1 epoch; writes nothing")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    python = setup_pytagi_venv()
    epochs = 1 if args.quick else EPOCHS
    record: dict = {"command": command_line(), "epochs": epochs, "batch_size": BATCH,
                    "sigma_v": SIGMA_V, "threads": 1, "networks": {}}
    pytagi_version = None
    with tempfile.TemporaryDirectory() as tmp:
        for network, seeds in SEEDS.items():
            rows: dict[str, list[dict]] = {"pytagi": [], "dptrain": []}
            for seed in range(1 if args.quick else seeds):
                data = make_data(network, seed, epochs)
                data_file = Path(tmp) / f"{network}{seed}.npz"
                np.savez(data_file, **data)
                theirs = run_pytagi(python, network, data_file, seed)
                pytagi_version = theirs.pop("version")
                rows["pytagi"].append({"seed": seed, **theirs})
                rows["dptrain"].append({"seed": seed, **run_ours(network, data, seed)})
            summary = {}
            for name, runs in rows.items():
                errors = [100 * r["test_error"] for r in runs]
                summary[name] = {"mean_test_error_percent": statistics.mean(errors),
                                 "min_percent": min(errors), "max_percent": max(errors)}
                print(f"{network} {name:7}: test error % per seed "
                      f"{' / '.join(f'{e:.2f}' for e in errors)}, mean "
                      f"{summary[name]['mean_test_error_percent']:.2f}")
            record["networks"][network] = {"seeds": len(rows["pytagi"]), "per_seed": rows,
                                           "summary": summary}
    record.update(pytagi=pytagi_version, torch=torch.__version__, hardware=hardware(),
                  git=git_describe())
    if not args.quick:
        write_json(args.output, record)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
