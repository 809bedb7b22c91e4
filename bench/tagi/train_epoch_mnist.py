"""What a real run costs here: one epoch of `dptrain train --model tagi-cnn` on MNIST-sized data
(60,000 synthetic 28x28 images in the IDX format, 10,000 test images), 2 processes.

    .venv/bin/python bench/tagi/train_epoch_mnist.py   # writes bench/results/train_epoch_mnist.json
    .venv/bin/python bench/tagi/train_epoch_mnist.py --quick  # 6,000 images, writes nothing

Reports the run's wall time (start-up, the epoch, the exact evaluation and the checkpoint) and
its training samples/s, as `summary.json` records them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for `common`
from common import RESULTS as RESULTS_DIR, cpu_model  # noqa: E402

from dptrain.data.datasets.synthetic import write_synthetic_mnist  # noqa: E402

RESULTS = RESULTS_DIR / "train_epoch_mnist.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-train", type=int, default=60_000)
    p.add_argument("--num-test", type=int, default=10_000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="global")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.num_train, args.num_test = 6_000, 1_000
    with tempfile.TemporaryDirectory() as tmp:
        data = write_synthetic_mnist(Path(tmp) / "mnist", num_train=args.num_train,
                                     num_test=args.num_test)
        out = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "dptrain", "train", "--model", "tagi-cnn", "--dataset",
               f"mnist:{data}", "--epochs", "1", "--nproc", str(args.nproc), "--batch-size",
               str(args.batch_size), "--no-progress", "--out", str(out)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        wall = time.perf_counter() - start
        summary = json.loads((out / "summary.json").read_text())
    record = {"config": vars(args), "command_wall_s": wall,
              "trainer_wall_s": summary["wall_time_s"],
              "samples_per_s": summary["samples_per_s"], "test_error": summary["test_error"],
              "cpu": cpu_model(), "python": platform.python_version()}
    print(f"tagi-cnn, {args.num_train} images, {args.nproc} processes, batch "
          f"{args.batch_size}: {wall:.1f} s for the command, {summary['wall_time_s']:.1f} s in "
          f"the trainer, {summary['samples_per_s']:.0f} samples/s")
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
