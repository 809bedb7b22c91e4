"""Run-directory outputs: a CSV of every epoch, TensorBoard events when available, PNG plots.

Only rank 0 creates these. The CSV is rewritten whole from the history at every epoch, so a
resumed run's file holds each epoch once even if the killed attempt had logged more.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

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


class TensorBoardLogger:
    """Scalars per epoch; a no-op when tensorboard is not installed."""

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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib not installed: no plots (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(path: Path, history: list[dict[str, Any]]) -> bool:
    """One panel per metric, train and test against the epoch."""
    plt = _pyplot()
    if plt is None or not history:
        return False
    names = sorted({k.split("_", 1)[1] for r in history for k in r
                    if k.startswith(("train_", "test_")) and isinstance(r[k], (int, float))})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.5), squeeze=False)
    epochs = [r["epoch"] for r in history]
    for ax, name in zip(axes[0], names):
        for split in ("train", "test"):
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


def plot_regression_band(path: Path, x_train, y_train, x_test, y_test, mean, epistemic_std,
                         total_std) -> bool:
    """Predictive mean with ±2σ bands over 1-D test inputs, data points on top: the epistemic
    band (the model's uncertainty) inside the total band (with the observation noise)."""
    plt = _pyplot()
    if plt is None:
        return False
    order = x_test.reshape(-1).argsort()
    xs, m = x_test.reshape(-1)[order], mean.reshape(-1)[order]
    s_epi, s_tot = epistemic_std.reshape(-1)[order], total_std.reshape(-1)[order]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.fill_between(xs, m - 2 * s_tot, m + 2 * s_tot, alpha=0.2, color="C0",
                    label="±2σ total (with noise)")
    ax.fill_between(xs, m - 2 * s_epi, m + 2 * s_epi, alpha=0.45, color="C0",
                    label="±2σ epistemic")
    ax.plot(xs, m, color="C0", label="predictive mean")
    ax.scatter(x_test.reshape(-1), y_test.reshape(-1), s=6, color="k", alpha=0.5, label="test")
    ax.scatter(x_train.reshape(-1), y_train.reshape(-1), s=18, color="C3", label="train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_reliability(path: Path, bins: list[dict[str, float]]) -> bool:
    """Reliability diagram: accuracy against confidence per bin, the share of samples below."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    centres = [(b["low"] + b["high"]) / 2 for b in bins]
    width = bins[0]["high"] - bins[0]["low"]
    top.bar(centres, [b["accuracy"] if b["share"] else 0.0 for b in bins], width=width * 0.9,
            color="C0", edgecolor="k", label="accuracy")
    top.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ece = sum(b["gap"] for b in bins)
    top.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title=f"ECE {ece:.3f}")
    top.legend(loc="upper left")
    bottom.bar(centres, [b["share"] for b in bins], width=width * 0.9, color="C1", edgecolor="k")
    bottom.set(xlabel="confidence (highest class probability)", ylabel="share")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
