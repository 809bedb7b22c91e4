"""Run-directory outputs: a CSV of every epoch, one of every rank's step times, TensorBoard events
when available, learning curves.

Only rank 0 creates these. epochs.csv is rewritten whole from the history at every epoch, so a
resumed run's file holds each epoch once even if the killed attempt had logged more; ranks.csv
keeps the earlier epochs' rows it finds and replaces the current epoch's.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

from dptrain.learners.plots import pyplot

log = logging.getLogger(__name__)


def write_csv(path: Path, history: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for record in history:
        columns += [k for k in record if k not in columns]
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(history)
    tmp.replace(path)


def write_rank_times(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace the rows of `rows`' epoch (and any later one, left by a killed attempt) in the
    per-rank CSV at `path`, keeping the earlier epochs' rows."""
    epoch = rows[0]["epoch"]
    kept: list[dict[str, Any]] = []
    if path.exists():
        with open(path, newline="") as f:
            kept = [r for r in csv.DictReader(f) if int(r["epoch"]) < epoch]
    write_csv(path, [*kept, *rows])


class TensorBoardLogger:
    """Scalars per epoch, and per step for the few that change every step (learning rate); a
    no-op when tensorboard is not installed."""

    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard not installed: no event files (pip install tensorboard)")
            self.writer = None
            return
        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key not in ("epoch", "step") and isinstance(value, (int, float)) \
                    and math.isfinite(value):
                self.writer.add_scalar(key.replace("_", "/", 1), value, record["epoch"])
        self.writer.flush()

    def log_step(self, scalars: dict[str, float], step: int) -> None:
        """Per-step values (the learning rate) against the global step, as `step/NAME`."""
        if self.writer is None:
            return
        for key, value in scalars.items():
            self.writer.add_scalar(f"step/{key}", value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def plot_learning_curves(path: Path, history: list[dict[str, Any]]) -> bool:
    """One panel per metric, train, validation and test against the epoch."""
    plt = pyplot()
    if plt is None or not history:
        return False
    names = sorted({k.split("_", 1)[1] for r in history for k in r
                    if k.startswith(("train_", "val_", "test_"))
                    and isinstance(r[k], (int, float))})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.5), squeeze=False)
    epochs = [r["epoch"] for r in history]
    for ax, name in zip(axes[0], names):
        for split in ("train", "val", "test"):
            key = f"{split}_{name}"
            if any(key in r for r in history):
                ax.plot(epochs, [r.get(key, math.nan) for r in history], marker="o", label=split)
        ax.set_xlabel("epoch")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
