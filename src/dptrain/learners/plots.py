"""The learners' own plots: a reliability diagram for classifiers, predictive bands for 1-D
regression. matplotlib is optional; without it these draw nothing and say so in the log."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib not installed: no plots (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_regression_band(path: Path, x_train, y_train, x_test, y_test, mean, epistemic_std,
                         total_std) -> bool:
    """Predictive mean with ±2σ bands over 1-D test inputs, data points on top: the epistemic
    band (the model's uncertainty) inside the total band (with the observation noise)."""
    plt = pyplot()
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
    plt = pyplot()
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
