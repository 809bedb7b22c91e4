"""Telling a collapsed TAGI run from a healthy one, from the evaluation a run does anyway.

A TAGI network collapses when, early in training, every unit of one ReLU layer turns negative
for every input: from then on that layer outputs zeros, its Jacobian is zero, no innovation
reaches the layers below it, and the layers above see the same input for every sample. The
network's predictions stop depending on its input, for good (docs/tagi.md, Collapsed runs).
That is the signal: over the test set, the predicted means of every output vary by less than
`SPREAD_TOL` (outputs are in normalised units: hierarchical-softmax outputs, or targets scaled
to unit variance). Measured on 28x28 digits: the collapsed runs spread 6e-5 at most (exactly 0
in most), the healthy ones 0.38 at least, also those still at chance after their first epoch
that go on to learn. The test holds for regression as for classification; a regression whose
targets do not depend on the inputs at all could trip it, and then the warning is right in
saying that the predictions ignore the inputs.

A learner adds `output_sums` to its evaluation metrics (sums and counts, so they reduce over
ranks exactly like the others); `pop_output_spread` takes them out again in `end_evaluation`,
on every rank with the same numbers, so every rank reaches the same verdict.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dptrain.errors import TrainingCollapsed
from dptrain.learners.protocol import Metrics

SPREAD_TOL = 1e-3
"""Largest standard deviation over the test set of an output's predicted mean that still counts
as constant (normalised units)."""
PREFIX = "out_k"
SEVERAL = "out_several"
REMEDIES = ("try --gain 0.5 (smaller initial weight variances), MixtureReLU or BatchNorm after "
            "the convolutions (a model file), or another --seed")


def is_collapse_metric(name: str) -> bool:
    """True for the entries `output_sums` adds (they count samples, not targets)."""
    return name == SEVERAL or name.startswith(PREFIX)


def output_sums(mu: torch.Tensor) -> Metrics:
    """Per output column k of the (B, K) predicted means: Σμ_k and Σμ_k² over the batch; and
    whether the batch holds several samples (one sample alone has no spread to measure)."""
    n = float(mu.shape[0])
    mu = mu.detach().reshape(mu.shape[0], -1).double()
    sums, squares = mu.sum(0).tolist(), (mu * mu).sum(0).tolist()
    out: Metrics = {SEVERAL: (float(n >= 2), 1.0)}
    for k, (s, q) in enumerate(zip(sums, squares)):
        out[f"{PREFIX}{k}_sum"] = (s, n)
        out[f"{PREFIX}{k}_sq"] = (q, n)
    return out


def pop_output_spread(means: dict[str, float]) -> float | None:
    """Remove `output_sums`' entries from `means`; the largest standard deviation over the
    samples of one output's mean (None if there were none, or no batch held two samples)."""
    several = means.pop(SEVERAL, 0.0) > 0
    spread = None
    k = 0
    while f"{PREFIX}{k}_sum" in means:
        mean, square = means.pop(f"{PREFIX}{k}_sum"), means.pop(f"{PREFIX}{k}_sq")
        std = math.sqrt(max(square - mean * mean, 0.0))
        spread = std if spread is None else max(spread, std)
        k += 1
    return spread if several else None


def verdict(spread: float | None, epoch: int,
            top_class_share: float | None = None) -> dict[str, Any] | None:
    """The collapse record of an evaluation after epoch `epoch` (from 1), or None when the run
    looks healthy or there is nothing to tell from (`spread` None)."""
    if spread is None or not spread < SPREAD_TOL:
        return None
    record: dict[str, Any] = {"epoch": epoch, "output_spread": spread,
                              "symptom": "the predictions no longer depend on the input"}
    if top_class_share is not None:
        record["top_class_share"] = top_class_share
    return record


def message(record: dict[str, Any]) -> str:
    """The one warning line (and `TrainingCollapsed`'s message)."""
    share = record.get("top_class_share")
    in_class = "" if share is None else f", {100 * share:.0f} % of them in one class"
    return (f"TAGI run collapsed at epoch {record['epoch']}: {record['symptom']} (test "
            f"predictions spread {record['output_spread']:.1e}{in_class}); it will not learn "
            f"any more: {REMEDIES}")


def check(record: dict[str, Any] | None, stop: bool) -> None:
    """Raise `TrainingCollapsed` for a collapse when asked to stop on one."""
    if record is not None and stop:
        raise TrainingCollapsed(message(record))
