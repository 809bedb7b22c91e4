"""Hierarchical softmax coding (docs/tagi.md, Hierarchical softmax)."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.tagi import HRCSoftmax

K10_INDEX_TABLE = [[1, 2, 4, 7], [1, 2, 4, 7], [1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 5, 9],
                   [1, 2, 5, 9], [1, 2, 5, 10], [1, 2, 5, 10], [1, 3, 6, 11], [1, 3, 6, 11]]


def test_k10_index_table_and_observations():
    hrc = HRCSoftmax(10)
    assert hrc.num_outputs == 11 and hrc.num_obs == 4
    assert hrc.idx.tolist() == K10_INDEX_TABLE
    for label in range(10):  # observations: +1 for binary digit 0, −1 for 1, MSB first
        bits = [(label >> (3 - c)) & 1 for c in range(4)]
        assert hrc.obs[label].tolist() == [-1.0 if b else 1.0 for b in bits]
    assert hrc.obs[2].tolist() == [1.0, 1.0, -1.0, 1.0]


@pytest.mark.parametrize("num_classes,num_outputs", [(2, 1), (3, 3), (4, 3), (8, 7), (16, 15)])
def test_sizes(num_classes, num_outputs):
    hrc = HRCSoftmax(num_classes)
    assert hrc.num_obs == math.ceil(math.log2(num_classes))
    assert hrc.num_outputs == num_outputs
    # every class has a distinct code
    assert len({tuple(row) for row in hrc.obs.tolist()}) == num_classes


def test_encode():
    hrc = HRCSoftmax(10)
    y_obs, y_idx = hrc.encode(torch.tensor([2, 9, 0]))
    assert y_obs.dtype == torch.float32 and y_idx.dtype == torch.int64
    assert y_idx.tolist() == [K10_INDEX_TABLE[2], K10_INDEX_TABLE[9], K10_INDEX_TABLE[0]]
    assert y_obs.tolist() == [[1, 1, -1, 1], [-1, 1, 1, -1], [1, 1, 1, 1]]


def test_probabilities_and_predict():
    """Outputs that encode a class with confidence predict it; probabilities are in [0, 1]."""
    hrc = HRCSoftmax(10)
    labels = torch.arange(10)
    y_obs, y_idx = hrc.encode(labels)
    mu = torch.zeros(10, 11)
    mu.scatter_(1, y_idx - 1, 5.0 * y_obs)
    var = torch.full((10, 11), 0.01)
    probs = hrc.probabilities(mu, var)
    assert probs.shape == (10, 10)
    assert bool((probs >= 0).all()) and bool((probs.sum(1) <= 1 + 1e-6).all())
    assert torch.equal(hrc.predict(mu, var), labels)
    assert bool((probs.diagonal() > 0.9).all())


def test_node_probability_formula():
    """P(class) = Π over its path of Φ(m/sqrt(1/α² + v)) or its complement."""
    hrc = HRCSoftmax(3)  # codes 00, 01, 10 on nodes [1,2], [1,2], [1,3]
    mu = torch.tensor([[0.4, -0.2, 1.0]], dtype=torch.float64)
    var = torch.tensor([[0.5, 0.1, 0.2]], dtype=torch.float64)
    p = torch.special.ndtr(mu / torch.sqrt(var + 1 / 9))[0]
    expected = [p[0] * p[1], p[0] * (1 - p[1]), (1 - p[0]) * p[2]]
    torch.testing.assert_close(hrc.probabilities(mu, var)[0], torch.stack(expected))
