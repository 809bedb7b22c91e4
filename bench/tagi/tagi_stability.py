"""How often TAGI CNN runs collapse to chance, dptrain's defaults beside pytagi 0.2.1's, over
seeds on the same data in the same order: the collapse rate and the median test error of each.

    .venv/bin/python bench/tagi/tagi_stability.py                 # 20 seeds, 3 epochs
    .venv/bin/python bench/tagi/tagi_stability.py --seeds 2 --epochs 1 --no-json   # a quick look

pytagi's CNN runs much slower than dptrain's on the CPU (about a minute per 3-epoch run at
28x28, several at 32x32x3, on a loaded 2-core machine): `--pytagi-seeds N` runs its side on the
first N seeds only (0: not at all).

writes bench/results/tagi_stability.json.

Data sets, written as the files a user would train on (bench/common/digit_files.py): `mnist` is
scikit-learn's digits in MNIST IDX files (28x28, first 1500 train, last 297 test), `cifar` the
same digits in CIFAR-10 binary batches (32x32, random ink and paper colours), `digits-image` the
built-in 8x8 digits (1437 / 360). Every run: the HRC head (10 classes, 11 outputs), σ_v 0.05,
batch 32, float32, one thread, the registry's CNN layout for the image size, one permutation per
epoch from `numpy.random.default_rng(seed)`, the same for both libraries. Configurations:
`dptrain tagi-cnn` (the registry default), `dptrain tagi-cnn-pytagi` (pytagi's
initialisation, gain 1), `pytagi` (pytagi's own layers, its default gain 1) and `pytagi gain
0.5` (pytagi's layers at dptrain's default gain, where the default differs). A run counts as
collapsed when its test predictions no longer depend on the input (largest standard deviation
over the test set of an output's mean below `dptrain.learners.collapse.SPREAD_TOL`), the
learner's own test; those runs also sit at chance (about 90 % error).
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

from dptrain.data import load_dataset
from dptrain.learners.collapse import SPREAD_TOL
from dptrain.models import ModelOptions, build_model, cnn_default_gain, image_shape
from dptrain.tagi import HRCSoftmax, OutputUpdater, manual_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import (PYTAGI_DIR, PYTAGI_VENV, RESULTS, command_line,  # noqa: E402
                    git_describe, hardware, setup_pytagi_venv, write_json)
from common.digit_files import write_cifar_digits, write_mnist_digits  # noqa: E402

DEFAULT_OUTPUT = RESULTS / "tagi_stability.json"
BATCH, SIGMA_V = 32, 0.05
DATASETS = ("mnist", "cifar", "digits-image")


def load(name: str, tmp: Path):
    if name == "mnist":
        return load_dataset(f"mnist:{write_mnist_digits(tmp / 'mnist')}")
    if name == "cifar":
        return load_dataset(f"cifar10:{write_cifar_digits(tmp / 'cifar')}")
    return load_dataset(name)


def configurations(shape: tuple[int, int, int]) -> list[tuple[str, str, dict]]:
    """(label, side, settings) per configuration run on images of `shape`."""
    default_gain = cnn_default_gain(shape)
    rows = [("dptrain tagi-cnn", "dptrain", {"model": "tagi-cnn"}),
            ("dptrain tagi-cnn-pytagi", "dptrain", {"model": "tagi-cnn-pytagi"}),
            ("pytagi", "pytagi", {"gain": 1.0})]
    if default_gain != 1.0:
        rows.append((f"pytagi gain {default_gain:g}", "pytagi", {"gain": default_gain}))
    return rows


def run_dptrain(model: str, split, orders: np.ndarray, seed: int) -> dict:
    """The learner's step (update_using_indices with σ_v², backward, step) in the given order."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    manual_seed(seed)
    net = build_model(model, split.input_shape, 11, ModelOptions())
    hrc, updater = HRCSoftmax(num_classes=10), OutputUpdater(net.device)
    x, y = split.train.x, split.train.y
    start = time.perf_counter()
    for order in torch.from_numpy(orders):
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            net(x[idx])
            obs, obs_idx = hrc.encode(y[idx])
            updater.update_using_indices(net.output_z_buffer, obs, SIGMA_V ** 2, obs_idx,
                                         net.input_delta_z_buffer)
            net.backward()
            net.step()
    seconds = time.perf_counter() - start
    net.eval()
    mu, var = net(split.test.x)
    wrong = int((hrc.predict(mu, var) != split.test.y).sum())
    return {"test_error": wrong / len(split.test.y), "seconds": seconds,
            "output_spread": float(mu.double().std(0).max())}


def run_pytagi(python: Path, data_file: Path, shape, gain: float, seed: int) -> dict:
    nccl_libs = sorted(PYTAGI_VENV.glob("lib/python*/site-packages/nvidia/nccl/lib"))
    env = {"LD_LIBRARY_PATH": str(nccl_libs[-1]), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    args = json.dumps({"data": str(data_file), "network": "cnn-plan", "shape": list(shape),
                       "gain": gain, "seed": seed, "threads": 1})
    out = subprocess.run([str(python), str(PYTAGI_DIR / "_pytagi_digits_worker.py"), args],
                         check=True, env=env, timeout=1800, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    errors = [100 * r["test_error"] for r in runs]
    collapsed = [r["seed"] for r in runs if r["output_spread"] < SPREAD_TOL]
    return {"runs": len(runs), "collapsed": len(collapsed), "collapsed_seeds": collapsed,
            "collapse_rate": len(collapsed) / len(runs),
            "median_test_error_percent": statistics.median(errors),
            "median_healthy_test_error_percent": statistics.median(
                [e for r, e in zip(runs, errors) if r["seed"] not in collapsed] or [float("nan")])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--pytagi-seeds", type=int, default=None,
                   help="seeds of the pytagi side (default: --seeds; 0: skip it)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--no-json", action="store_true", help="print only")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    pytagi_seeds = args.seeds if args.pytagi_seeds is None else args.pytagi_seeds
    python = setup_pytagi_venv()
    record: dict = {"command": command_line(), "seeds": args.seeds, "pytagi_seeds": pytagi_seeds,
                    "epochs": args.epochs,
                    "batch_size": BATCH, "sigma_v": SIGMA_V, "threads": 1, "datasets": {}}
    print(f"{'data':13}{'configuration':26}{'collapsed':>10}{'median error %':>16}"
          f"{'healthy median %':>18}")
    version = None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in args.datasets:
            split = load(name, tmp)
            shape = image_shape(split.input_shape)
            per_config: dict[str, dict] = {}
            for label, side, settings in configurations(shape):
                runs = []
                num_seeds = args.seeds if side == "dptrain" else pytagi_seeds
                if num_seeds == 0:
                    continue
                for seed in range(num_seeds):
                    order_rng = np.random.default_rng(seed)
                    orders = np.stack([order_rng.permutation(len(split.train))
                                       for _ in range(args.epochs)])
                    if side == "dptrain":
                        result = run_dptrain(settings["model"], split, orders, seed)
                    else:
                        data_file = tmp / f"{name}-{seed}.npz"
                        np.savez(data_file, x_train=split.train.x.numpy(),
                                 y_train=split.train.y.numpy(), x_test=split.test.x.numpy(),
                                 y_test=split.test.y.numpy(), orders=orders,
                                 batch_size=np.array(BATCH), sigma_v=np.array(SIGMA_V))
                        result = run_pytagi(python, data_file, shape, settings["gain"], seed)
                        version = result.pop("version")
                    runs.append({"seed": seed, **result})
                summary = summarise(runs)
                per_config[label] = {"settings": settings, "summary": summary, "per_seed": runs}
                print(f"{name:13}{label:26}{summary['collapsed']:>5} / {summary['runs']:<3}"
                      f"{summary['median_test_error_percent']:>15.1f}"
                      f"{summary['median_healthy_test_error_percent']:>18.1f}", flush=True)
                record["datasets"][name] = per_config
                if not args.no_json:  # so far, in case a slow pytagi side is cut short
                    write_json(args.output, {**record, "complete": False})
    record.update(pytagi=version, torch=torch.__version__, hardware=hardware(),
                  git=git_describe(), complete=True)
    if not args.no_json:
        write_json(args.output, record)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
