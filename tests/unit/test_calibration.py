"""Expected calibration error from per-bin sums that add over batches and ranks."""

from __future__ import annotations

import pytest
import torch

from dptrain.learners.calibration import (NUM_BINS, calibration_sums,
                                          expected_calibration_error, pop_calibration)


def _direct_ece(probs: torch.Tensor, labels: torch.Tensor) -> float:
    conf, pred = probs.max(1)
    ece = 0.0
    for k in range(NUM_BINS):
        inside = (conf >= k / NUM_BINS) & (conf < (k + 1) / NUM_BINS) if k < NUM_BINS - 1 \
            else conf >= k / NUM_BINS
        if inside.any():
            acc = (pred[inside] == labels[inside]).double().mean()
            ece += inside.double().mean().item() * abs(acc.item() - conf[inside].mean().item())
    return ece


def _means(*metric_dicts) -> dict[str, float]:
    total: dict[str, tuple[float, float]] = {}
    for metrics in metric_dicts:
        for name, (s, c) in metrics.items():
            a, b = total.get(name, (0.0, 0.0))
            total[name] = (a + s, b + c)
    return {name: s / c for name, (s, c) in total.items()}


def test_ece_from_sums_over_batches_equals_the_direct_formula():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(500, 10, generator=g, dtype=torch.float64), 1)
    labels = torch.randint(0, 10, (500,), generator=g)
    parts = [calibration_sums(probs[a:b], labels[a:b]) for a, b in ((0, 123), (123, 123),
                                                                     (123, 500))]
    bins = pop_calibration(_means(*parts))
    assert expected_calibration_error(bins) == pytest.approx(_direct_ece(probs, labels),
                                                             rel=1e-12)
    assert sum(b["share"] for b in bins) == pytest.approx(1.0)


def test_a_perfectly_calibrated_and_a_confidently_wrong_model():
    labels = torch.tensor([0, 1, 0, 1])
    certain_right = torch.nn.functional.one_hot(labels, 2).double()
    certain_wrong = 1 - certain_right
    assert expected_calibration_error(pop_calibration(
        _means(calibration_sums(certain_right, labels)))) == 0.0
    assert expected_calibration_error(pop_calibration(
        _means(calibration_sums(certain_wrong, labels)))) == 1.0


def test_pop_calibration_leaves_other_metrics_and_ignores_their_absence():
    means = {"error": 0.1, **_means(calibration_sums(torch.eye(3), torch.arange(3)))}
    assert pop_calibration(means) is not None and means == {"error": 0.1}
    assert pop_calibration({"mse": 1.0}) is None
