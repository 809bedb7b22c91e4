"""What `dptrain train` starts on every process it launches: `run_training` on its options."""

from __future__ import annotations

import sys
from pathlib import Path

from dptrain.launcher.worker import run_as_worker
from dptrain.train.job import run_training
from dptrain.train.options import TrainOptions


def main() -> None:
    options = TrainOptions.from_json(Path(sys.argv[1]).read_text())
    # `dptrain train` ran the preflight before it started this worker
    run_as_worker(lambda: run_training(options, preflown=True), "train")


if __name__ == "__main__":
    main()
