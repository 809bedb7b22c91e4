"""How well predicted probabilities match how often the model is right.

Expected calibration error (ECE) over equal-width confidence bins: the share of samples in each
bin times the gap between the bin's accuracy and its mean confidence, summed. A learner reports
each bin's sums as metrics over the number of samples N, so they add over batches and ranks like
every other metric, and their means are exactly the terms ECE needs:

    calib_b{k}_count = n_k / N,  calib_b{k}_conf = Σ conf / N,  calib_b{k}_acc = Σ correct / N
    ECE = Σ_k |calib_b{k}_acc − calib_b{k}_conf|
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dptrain.learners.plots import plot_reliability
from dptrain.learners.protocol import Metrics

NUM_BINS = 10
PREFIX = "calib_b"


def calibration_sums(probs: torch.Tensor, labels: torch.Tensor) -> Metrics:
    """Per-bin sums of (B, C) class probabilities against (B,) labels; B may be 0."""
    n = float(labels.shape[0])
    if labels.shape[0] == 0:
        zeros = [0.0] * NUM_BINS
        counts = confs = hits = zeros
    else:
        conf, predicted = probs.detach().max(1)
        conf = conf.double().cpu()
        correct = (predicted.cpu() == labels.cpu().long()).double()
        bins = (conf * NUM_BINS).long().clamp_(0, NUM_BINS - 1)
        counts = torch.bincount(bins, minlength=NUM_BINS).tolist()
        confs = torch.bincount(bins, weights=conf, minlength=NUM_BINS).tolist()
        hits = torch.bincount(bins, weights=correct, minlength=NUM_BINS).tolist()
    out: Metrics = {}
    for k in range(NUM_BINS):
        out[f"{PREFIX}{k}_count"] = (float(counts[k]), n)
        out[f"{PREFIX}{k}_conf"] = (float(confs[k]), n)
        out[f"{PREFIX}{k}_acc"] = (float(hits[k]), n)
    return out


def pop_calibration(means: dict[str, float]) -> list[dict[str, float]] | None:
    """Remove the bin metrics from `means`; per bin: share of samples, confidence, accuracy
    (the latter two as means within the bin, NaN for an empty bin). None if there were none."""
    if f"{PREFIX}0_count" not in means:
        return None
    bins = []
    for k in range(NUM_BINS):
        share = means.pop(f"{PREFIX}{k}_count")
        conf, acc = means.pop(f"{PREFIX}{k}_conf"), means.pop(f"{PREFIX}{k}_acc")
        bins.append({"low": k / NUM_BINS, "high": (k + 1) / NUM_BINS, "share": share,
                     "confidence": conf / share if share else float("nan"),
                     "accuracy": acc / share if share else float("nan"),
                     "gap": abs(acc - conf)})
    return bins


def confidence_gap(means: dict[str, float]) -> float:
    """|mean confidence − accuracy| over all of an evaluation's samples, from the means of its
    bin sums (ECE with a single bin: calibration in the large); NaN without them."""
    if f"{PREFIX}0_count" not in means:
        return float("nan")
    return abs(sum(means[f"{PREFIX}{k}_conf"] - means[f"{PREFIX}{k}_acc"]
                   for k in range(NUM_BINS)))


def expected_calibration_error(bins: list[dict[str, float]]) -> float:
    return sum(b["gap"] for b in bins)


def end_evaluation(means: dict[str, float]
                   ) -> tuple[dict[str, float], list[dict[str, float]] | None]:
    """The evaluation's metrics with its calibration bins folded into `ece`, and the bins."""
    bins = pop_calibration(means)
    if bins is not None:
        means["ece"] = expected_calibration_error(bins)
    return means, bins


def report(out_dir: Path | None, bins: list[dict[str, float]] | None) -> dict[str, Any]:
    """The bins for the run's summary; rank 0 (`out_dir` given) also draws reliability.png."""
    if bins is None:
        return {}
    if out_dir is not None:
        plot_reliability(out_dir / "reliability.png", bins)
    return {"calibration_bins": bins}
