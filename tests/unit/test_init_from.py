"""`dptrain.train.init_from` in the library: sequential Bayesian learning (TAGI's posterior as
the next run's prior) and the matching rules of a start from another run's weights."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.runtime import Runtime
from dptrain.runtime.env import SINGLE
from dptrain.errors import ConfigError
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.tagi import BatchNorm2d, Conv2d, Linear, ReLU, Sequential, manual_seed
from dptrain.train.init_from import InitOptions, Source, freeze, initialise

RUNTIME = Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60))


def _net(seed: int) -> Sequential:
    manual_seed(seed)
    return Sequential(Conv2d(1, 4, 3, padding=1, in_width=6, in_height=6), ReLU(),
                      BatchNorm2d(4), Linear(4 * 36, 3))


def _batches(seed: int, num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 6, 6, generator=g),
             torch.randn(8, 1, 6, 6, generator=g)[:, 0, :3, 0]) for _ in range(num)]


def _learner(net: Sequential) -> TagiLearner:
    learner = TagiLearner(net, task="regression", sigma_v=0.5)
    learner.setup(RUNTIME)
    return learner


def _source(weights: dict[str, torch.Tensor]) -> Source:
    return Source(spec="A", checkpoint=Path("A"), step=3, kind="tagi", model="net",
                  weights=weights, normalisation={})


def test_training_on_b_from_the_posterior_of_a_equals_one_pass_over_a_then_b():
    """Sequential Bayes: A then B from A's posterior (means, variances, BatchNorm statistics)
    is one pass over A then B, in sum mode, whatever the second network's own initialisation."""
    part_a, part_b = _batches(1, 3), _batches(2, 3)
    whole = _learner(_net(seed=0))
    for batch in part_a + part_b:
        whole.train_step(batch)

    first = _learner(_net(seed=0))
    for batch in part_a:
        first.train_step(batch)
    posterior = first.model.state_dict()
    assert any(k.endswith("mu_ra") for k in posterior)  # BatchNorm's statistics travel too

    second_net = _net(seed=7)  # another prior draw, replaced by A's posterior
    initialise(second_net, "tagi", _source(posterior), InitOptions(init_from="A"))
    second = _learner(second_net)
    for batch in part_b:
        second.train_step(batch)
    ours, expected = second.model.state_dict(), whole.model.state_dict()
    for name in expected:
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-6, atol=1e-7,
                                   msg=name)


def test_a_head_of_another_shape_is_re_initialised_as_in_a_new_network():
    source = _net(seed=0).state_dict()
    manual_seed(3)
    net = Sequential(Conv2d(1, 4, 3, padding=1, in_width=6, in_height=6), ReLU(),
                     BatchNorm2d(4), Linear(4 * 36, 5))
    fresh = net.state_dict()
    said = initialise(net, "tagi", _source(source), InitOptions(init_from="A"))
    assert said.endswith("re-initialised 3.mu_w (3, 144) -> (5, 144), 3.var_w (3, 144) -> "
                         "(5, 144), 3.mu_b (3,) -> (5,), 3.var_b (3,) -> (5,)")
    state = net.state_dict()
    assert torch.equal(state["0.mu_w"], source["0.mu_w"])
    assert torch.equal(state["3.mu_w"], fresh["3.mu_w"])


def test_freeze_takes_whole_name_prefixes():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert freeze(model, "0") == ["0.weight", "0.bias"]
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    with pytest.raises(ConfigError, match="--freeze 1: matches no parameter"):
        freeze(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), "1")
    with pytest.raises(ConfigError, match="freezes every parameter"):
        freeze(nn.Sequential(nn.Linear(2, 2)), "0")
