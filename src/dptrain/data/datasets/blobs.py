"""Three overlapping Gaussian classes: a classification set whose best possible error and
whose true class probabilities are known, for measuring calibration on noisy labels.

Class k (k = 0, 1, 2) is N(s·e_k, I) in 5 dimensions with s = 2.5/√2, so every two class
means are 2.5 apart. With equal priors the Bayes classifier picks the largest of x_0, x_1, x_2,
and its error is 1 − ∫ φ(x − s) Φ(x)² dx = 17.6 %: about one label in six lies on the "wrong"
side, so a model that is right 82 % of the time should be about 82 % confident on average.
"""

from __future__ import annotations

import math

import torch

from dptrain.data.datasets.base import ArrayDataset, Split
from dptrain.errors import ConfigError

NUM_CLASSES = 3
DIM = 5
SEPARATION = 2.5
"""Distance between every two class means, in units of the noise's standard deviation."""
SHIFT = SEPARATION / math.sqrt(2)
BAYES_ERROR = 0.176
"""The Bayes classifier's error on this data (the integral above, 0.1760)."""


def bayes_probabilities(x: torch.Tensor) -> torch.Tensor:
    """The true class probabilities P(k | x) (N, 3) of inputs (N, 5): softmax(s · x_{0..2})."""
    return torch.softmax(SHIFT * x[:, :NUM_CLASSES].double(), dim=1)


def _draw(num: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.arange(num) % NUM_CLASSES
    labels = labels[torch.randperm(num, generator=g)]
    x = torch.randn(num, DIM, generator=g, dtype=torch.float64)
    x[torch.arange(num), labels] += SHIFT
    return x, labels


def load_blobs(*, num_train: int = 2000, num_test: int = 2000, seed: int = 0) -> Split:
    """`num_train` and `num_test` samples (classes in turn, shuffled) drawn from a
    `torch.Generator` seeded with `seed`; inputs are left as drawn (unit noise already)."""
    if num_train < 1 or num_test < 1:
        raise ConfigError(f"blobs needs num_train >= 1 and num_test >= 1, got "
                          f"num_train={num_train}, num_test={num_test}")
    g = torch.Generator().manual_seed(seed)
    (x_tr, y_tr), (x_te, y_te) = _draw(num_train, g), _draw(num_test, g)
    return Split(name="blobs", task="classification", num_classes=NUM_CLASSES,
                 train=ArrayDataset(x_tr.float(), y_tr), test=ArrayDataset(x_te.float(), y_te))
