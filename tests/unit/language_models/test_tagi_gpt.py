"""tagi-gpt and the TAGI learner on token data (docs/tagi.md, A TAGI GPT): Linear per position
is Linear on each position, the network is causal, every position is observed through its own
slice of the output, and the loss, error and calibration are per token."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from dptrain.data.datasets.base import ArrayDataset, Split
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.errors import ConfigError
from dptrain.learners.build import create_learner
from dptrain.learners.calibration import NUM_BINS, PREFIX
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.models import ModelOptions, build_model
from dptrain.learners.tagi_learner import TagiLearner, encode_positions, hrc_probabilities
from dptrain.runtime import DistEnv, Runtime
from dptrain.tagi import HRCSoftmax, Linear, ReLU, Sequential, manual_seed, native
from dptrain.tagi.states import DeltaStates, HiddenStates

F64 = torch.float64
VOCAB, CONTEXT = 11, 8
HRC = HRCSoftmax(VOCAB)


def _runtime() -> Runtime:
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                  master_addr="127.0.0.1", master_port=0, launcher="single")
    return Runtime(env, "gloo", torch.device("cpu"), timedelta(seconds=30))


def _gpt(seed: int = 0, layers: int = 2) -> Sequential:
    manual_seed(seed)
    return build_model("tagi-gpt", (CONTEXT,), HRC.num_outputs,
                       ModelOptions(width=8, heads=2, layers=layers, vocab_size=VOCAB,
                                    dtype=F64))


def _ids(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, CONTEXT), generator=torch.Generator().manual_seed(seed))


def test_linear_per_position_is_linear_on_each_position_forward_and_backward():
    """(B, T·I) through Linear(I, O, per_position=True) equals (B·T, I) through Linear(I, O):
    output moments, the input's innovations and the parameter deltas (summed over positions)."""
    b, t, i, o = 3, 5, 4, 6
    manual_seed(0)
    per_position = Sequential(ReLU(), Linear(i, o, per_position=True), dtype=F64)
    rows = Sequential(ReLU(), Linear(i, o), dtype=F64)
    rows.load_state_dict(per_position.state_dict())
    g = torch.Generator().manual_seed(1)
    mu, var = torch.randn(b, t * i, generator=g, dtype=F64), torch.rand(b, t * i, generator=g,
                                                                         dtype=F64)
    delta = DeltaStates(torch.randn(b, t * o, generator=g, dtype=F64),
                        -torch.rand(b, t * o, generator=g, dtype=F64))
    out = []
    for net, shape in ((per_position, (b, t * i)), (rows, (b * t, i))):
        net.train()
        m, v = net(mu.reshape(shape), var.reshape(shape))
        layer = net.layers[1]
        back = layer.backward(DeltaStates(delta.delta_mu.reshape(m.shape),
                                          delta.delta_var.reshape(m.shape)), True)
        out.append((m.reshape(b, -1), v.reshape(b, -1), back.delta_mu.reshape(b, -1),
                    back.delta_var.reshape(b, -1), layer.delta_mu_w.clone(),
                    layer.delta_var_b.clone()))
    assert out[0][0].shape == (b, t * o)
    for got, expected in zip(*out):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    layer = per_position.layers[1]
    flat = layer.forward(HiddenStates(mu, var, None))
    three_d = layer.forward(HiddenStates(mu.reshape(b, t, i), var.reshape(b, t, i), None))
    assert three_d.mu_a.shape == (b, t, o)
    assert torch.equal(three_d.mu_a.reshape(b, -1), flat.mu_a)
    assert torch.equal(three_d.var_a.reshape(b, -1), flat.var_a)
    with pytest.raises(ValueError, match=r"per position, expected input \(batch, T·4\)"):
        per_position(torch.zeros(b, 7, dtype=F64))
    assert "per-position" in native.not_native(Sequential(Linear(i, o, per_position=True),
                                                          dtype=F64))


def test_the_tagi_gpt_is_causal_in_its_means_and_variances():
    """A token changed at position j changes no output moment at positions before j."""
    net = _gpt()
    net.eval()
    ids = _ids(2)
    mu, var = (t.reshape(2, CONTEXT, HRC.num_outputs) for t in net(ids))
    for j in (1, 4, CONTEXT - 1):
        changed = ids.clone()
        changed[:, j] = (changed[:, j] + 1) % VOCAB
        mu2, var2 = (t.reshape(2, CONTEXT, HRC.num_outputs) for t in net(changed))
        assert torch.equal(mu2[:, :j], mu[:, :j]) and torch.equal(var2[:, :j], var[:, :j]), j
        assert not torch.equal(mu2[:, j], mu[:, j]), j


def test_every_position_is_observed_through_its_own_outputs():
    """encode_positions gives position t the hierarchical softmax's observations of its own
    label at indices t·N + (1..N); ignored positions (-100) are refused in one line."""
    labels = _ids(3)
    obs, idx = encode_positions(HRC, labels, F64)
    assert obs.shape == idx.shape == (3, CONTEXT * HRC.num_obs)
    one_obs, one_idx = HRC.encode(labels.reshape(-1), dtype=F64)
    per_position = idx.reshape(3, CONTEXT, HRC.num_obs)
    offsets = torch.arange(CONTEXT)[None, :, None] * HRC.num_outputs
    assert torch.equal(per_position - offsets, one_idx.reshape(3, CONTEXT, -1))
    assert torch.equal(obs.reshape(-1, HRC.num_obs), one_obs)
    labels[1, 2] = -100
    with pytest.raises(ValueError, match="targets below 0 .ignored positions, -100. are not"):
        encode_positions(HRC, labels, F64)


def _token_split() -> Split:
    vocabulary = Vocabulary(kind="char", size=VOCAB, tokens=tuple("abcdefghij"))
    ids = _ids(40, seed=3)
    part = ArrayDataset(ids, torch.roll(ids, -1, 1))
    return Split(name="text:t.txt", train=part, validation=part, test=part,
                 task="classification", num_classes=VOCAB, vocabulary=vocabulary)


def test_a_training_step_and_the_metrics_are_per_token():
    """The learner built by `dptrain train --model tagi-gpt` steps on (B, T) windows; its loss
    is minus the mean log-probability per token under probabilities that sum to 1 over the
    vocabulary, and calibration counts tokens."""
    learner = create_learner(ModelConfig(model="tagi-gpt", width=8, layers=1, heads=2,
                                         precision="64"),
                             LearnerConfig(sigma_v=0.5), _token_split(), seed=0)
    assert isinstance(learner, TagiLearner)
    learner.setup(_runtime())
    x, y = _ids(4, seed=5), _ids(4, seed=6)
    before = learner.model.flat_params.clone()
    train = learner.train_step((x, y))
    assert not torch.equal(learner.model.flat_params, before)
    assert train["loss"][1] == train["error"][1] == 4 * CONTEXT
    metrics = learner.eval_step((x, y))
    learner.net.eval()
    mu, var = learner.net(x)
    rows = (4 * CONTEXT, HRC.num_outputs)
    probs = hrc_probabilities(learner.hrc, mu.reshape(rows), var.reshape(rows), True)
    torch.testing.assert_close(probs.sum(1), torch.ones(rows[0], dtype=F64))
    expected = -probs.gather(1, y.reshape(-1, 1)).log().sum().item()
    assert metrics["loss"] == (pytest.approx(expected, rel=1e-12), 4 * CONTEXT)
    assert metrics["log_likelihood"][0] == pytest.approx(-expected, rel=1e-12)
    counts = [v[0] for k, v in metrics.items() if k.startswith(PREFIX) and k.endswith("_count")]
    assert len(counts) == NUM_BINS and sum(counts) == 4 * CONTEXT


def test_bad_sizes_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="tagi-gpt: width 10 is not a multiple of heads 4"):
        ModelConfig(model="tagi-gpt", width=10, heads=4)
    with pytest.raises(ConfigError, match="even head size"):
        build_model("tagi-gpt", (CONTEXT,), HRC.num_outputs,
                    ModelOptions(width=6, heads=2, vocab_size=VOCAB))
    with pytest.raises(ConfigError, match="dropout is for"):
        ModelConfig(model="tagi-gpt", dropout=0.1)
