"""torch-gpt and the torch learner on token data: the model is GPT-2's decoder, and the loss,
error and calibration are per token, equal to torch's cross-entropy on the flattened logits."""

from __future__ import annotations

import functools
import math
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dptrain.data.datasets.base import IGNORE_INDEX, ArrayDataset, Split
from dptrain.data.datasets.user_data import _check_sample
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.errors import ConfigError, DataError
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.models.gpt import GPT, GPTConfig
from dptrain.learners.torch_learner import TorchLearner
from dptrain.runtime import DistEnv, Runtime

SMALL = GPTConfig(vocab_size=11, block_size=8, layers=2, heads=2, width=16)


def _runtime() -> Runtime:
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                  master_addr="127.0.0.1", master_port=0, launcher="single")
    return Runtime(env, "gloo", torch.device("cpu"), timedelta(seconds=30))


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def test_the_gpt_predicts_every_position_from_the_positions_before_it_only():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    ids = _ids(3, 8)
    logits = model(ids)
    assert logits.shape == (3, 8, SMALL.vocab_size)
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % SMALL.vocab_size
    again = model(changed)
    assert torch.equal(again[:, :5], logits[:, :5])      # causal: the past does not move
    assert not torch.allclose(again[:, 5:], logits[:, 5:])
    assert model(ids[:, :4]).shape == (3, 4, SMALL.vocab_size)  # shorter contexts too
    with pytest.raises(ValueError, match="longer than the model's context of 8"):
        model(_ids(1, 9))


def test_the_output_layer_is_the_token_embedding_and_the_init_is_gpt2s():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, layers=8, heads=4, width=256))
    assert model.head.weight is model.token_embedding.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names  # counted once
    residual = torch.cat([b.attn.proj.weight.flatten() for b in model.blocks])
    others = torch.cat([b.mlp.fc.weight.flatten() for b in model.blocks])
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert others.std().item() == pytest.approx(0.02, rel=0.05)
    assert not any(isinstance(m, nn.Linear) and m.bias is not None for m in model.modules())


def test_flops_per_token_count_six_per_weight_and_the_attention():
    model = GPT(SMALL)
    weights = model.num_parameters() - SMALL.block_size * SMALL.width
    expected = 6 * weights + 12 * SMALL.layers * SMALL.width * SMALL.block_size
    assert model.flops_per_token() == expected


def test_generation_is_the_seed_s_and_greedy_at_temperature_zero():
    torch.manual_seed(0)
    model = GPT(SMALL)
    start = _ids(1, 3)
    runs = [model.generate(start, 12, temperature=1.0, top_k=5,
                           generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert runs[0].shape == (1, 15) and torch.equal(runs[0][:, :3], start)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    greedy = model.generate(start, 4, temperature=0)
    step = start
    for _ in range(4):
        step = torch.cat([step, model(step)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, step)
    assert model.training  # generate leaves the mode as it found it


def _learner(model: nn.Module) -> TorchLearner:
    learner = TorchLearner(model, nn.CrossEntropyLoss(),
                           functools.partial(torch.optim.AdamW, lr=1e-3), per_position=True)
    learner.setup(_runtime())
    return learner


def test_the_loss_and_error_are_per_token_as_torchs_cross_entropy_on_flat_logits():
    torch.manual_seed(0)
    learner = _learner(GPT(SMALL))
    x, y = _ids(4, 8, seed=1), _ids(4, 8, seed=2)
    metrics = learner.eval_step((x, y))
    with torch.no_grad():
        logits = learner.module.eval()(x)
    flat, labels = logits.reshape(-1, SMALL.vocab_size), y.reshape(-1)
    loss_sum, count = metrics["loss"]
    assert count == 32
    assert loss_sum / count == pytest.approx(F.cross_entropy(flat, labels).item(), rel=1e-6)
    assert metrics["error"] == (float((flat.argmax(1) != labels).sum()), 32.0)
    bins = [metrics[k] for k in metrics if k.endswith("_count")]
    assert sum(b[0] for b in bins) == 32  # calibration counts every token once


def test_padded_positions_are_left_out_of_loss_error_and_calibration():
    torch.manual_seed(0)
    learner = _learner(GPT(SMALL))
    x, y = _ids(2, 8, seed=1), _ids(2, 8, seed=2)
    padded = y.clone()
    padded[1, 4:] = IGNORE_INDEX
    metrics = learner.eval_step((x, padded))
    with torch.no_grad():
        logits = learner.module(x)
    kept = padded.reshape(-1) != IGNORE_INDEX
    flat, labels = logits.reshape(-1, SMALL.vocab_size)[kept], padded.reshape(-1)[kept]
    assert metrics["loss"][1] == 12 and metrics["error"][1] == 12
    assert metrics["loss"][0] / 12 == pytest.approx(F.cross_entropy(flat, labels).item(),
                                                    rel=1e-6)
    assert sum(metrics[k][0] for k in metrics if k.endswith("_count")) == 12
    trained = learner.train_step((x, padded))
    assert trained["loss"][1] == 12


class _Embedder(nn.Module):
    """A user model that needs the ids as integers (an Embedding) and says what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.out = nn.Linear(4, 11)
        self.seen: list[torch.dtype] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.dtype)
        return self.out(self.embed(ids))


def test_integer_inputs_reach_a_user_model_unchanged():
    x, y = _ids(6, 8, seed=3), _ids(6, 8, seed=4)
    split = Split(name="mine", train=ArrayDataset(x, y), test=ArrayDataset(x, y),
                  task="classification", num_classes=11)
    _check_sample("mine.py:data", "train", split.train, split)  # accepted as a user dataset
    model = _Embedder()
    learner = _learner(model)
    learner.train_step((x, y))
    learner.eval_step((x, y))
    assert model.seen == [torch.int64, torch.int64]


def test_user_data_with_bad_token_targets_is_refused_in_one_line():
    x = _ids(2, 8)
    bad = Split(name="mine", train=ArrayDataset(x, torch.full((2, 8), 11)),
                test=ArrayDataset(x, x), task="classification", num_classes=11)
    with pytest.raises(DataError, match=r"train\[0\]: a classification target must be a class "
                                        r"id in \[0, 11\) or a vector of them"):
        _check_sample("mine.py:data", "train", bad.train, bad)
    flags = Split(name="mine", train=ArrayDataset(x.bool(), x), test=ArrayDataset(x, x),
                  task="classification", num_classes=11)
    with pytest.raises(DataError, match="the input must be a float tensor \\(or integer ids"):
        _check_sample("mine.py:data", "train", flags.train, flags)


def _token_split(vocabulary: Vocabulary | None) -> Split:
    x, y = _ids(6, 8), _ids(6, 8, seed=1)
    return Split(name="text:t.txt", train=ArrayDataset(x, y), test=ArrayDataset(x, y),
                 task="classification", num_classes=11, vocabulary=vocabulary)


def test_token_data_and_the_language_model_go_together_or_are_refused_in_one_line():
    vocabulary = Vocabulary(kind="char", size=11, tokens=tuple("abcdefghij"))
    learner = create_learner(ModelConfig(model="torch-gpt", width=8, layers=1, heads=2),
                             LearnerConfig(), _token_split(vocabulary), seed=0)
    assert isinstance(learner.module, GPT)
    assert learner.module.config.block_size == 8 and learner.module.config.vocab_size == 11
    with pytest.raises(ConfigError, match="windows of token ids need a language model"):
        create_learner(ModelConfig(model="torch-mlp"), LearnerConfig(),
                       _token_split(vocabulary), seed=0)
    with pytest.raises(ConfigError, match="torch-gpt is a language model; it trains on token"):
        create_learner(ModelConfig(model="torch-gpt"), LearnerConfig(), _token_split(None),
                       seed=0)
    with pytest.raises(ConfigError, match="width 10 is not a multiple of heads 4"):
        ModelConfig(model="torch-gpt", width=10, heads=4)
    with pytest.raises(ConfigError, match="betas are for optimizer adam or adamw"):
        LearnerConfig(optimizer="sgd", betas="0.9,0.99")
    with pytest.raises(ConfigError, match="betas"):
        LearnerConfig(betas="0.9")


def test_the_betas_reach_adamw_and_decay_spares_norms():
    vocabulary = Vocabulary(kind="char", size=11, tokens=tuple("abcdefghij"))
    learner = create_learner(ModelConfig(model="torch-gpt", width=8, layers=1, heads=2),
                             LearnerConfig(optimizer="adamw", betas="0.9,0.99",
                                           weight_decay=0.1),
                             _token_split(vocabulary), seed=0)
    learner.setup(_runtime())
    groups = learner.optimizer.param_groups
    assert [g["betas"] for g in groups] == [(0.9, 0.99)] * 2
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    module = learner.module
    assert id(module.token_embedding.weight) in decayed
    assert id(module.blocks[0].attn.qkv.weight) in decayed
    assert id(module.ln_final.weight) not in decayed


USER_LANGUAGE_MODEL = '''
from torch import nn

class Bigram(nn.Module):
    def __init__(self, vocabulary):
        super().__init__()
        self.logits = nn.Embedding(vocabulary, vocabulary)

    def forward(self, ids):
        return self.logits(ids)

def build(input_shape, num_outputs):
    return Bigram(num_outputs)
'''


def test_a_model_file_is_sized_with_token_ids_and_may_answer_every_position(tmp_path):
    path = tmp_path / "bigram.py"
    path.write_text(USER_LANGUAGE_MODEL)
    vocabulary = Vocabulary(kind="char", size=11, tokens=tuple("abcdefghij"))
    learner = create_learner(ModelConfig(model=f"{path}:build"), LearnerConfig(),
                             _token_split(vocabulary), seed=0)
    learner.setup(_runtime())
    metrics = learner.train_step((_ids(4, 8), _ids(4, 8, seed=1)))
    assert metrics["loss"][1] == 32


def test_generation_never_draws_the_unknown_id():
    torch.manual_seed(0)
    model = GPT(SMALL)
    with torch.no_grad():  # make the unknown id (the last) the likeliest by far
        model.token_embedding.weight[-1] *= 50
    free = model.generate(_ids(1, 3), 40, generator=torch.Generator().manual_seed(0))
    assert (free[:, 3:] == SMALL.vocab_size - 1).any()  # the test can see it drawn
    banned = model.generate(_ids(1, 3), 40, generator=torch.Generator().manual_seed(0),
                            never=SMALL.vocab_size - 1)
    assert not (banned[:, 3:] == SMALL.vocab_size - 1).any()


def test_mixup_of_token_ids_is_refused_in_one_line():
    vocabulary = Vocabulary(kind="char", size=11, tokens=tuple("abcdefghij"))
    with pytest.raises(ConfigError, match="integer ids \\(tokens\\), which cannot be blended"):
        create_learner(ModelConfig(model="torch-gpt", width=8, layers=1, heads=2),
                       LearnerConfig(mixup=0.2), _token_split(vocabulary), seed=0)


def test_bf16_autocast_trains_the_gpt_close_to_float32():
    """precision bf16 (CPU autocast: matrix products in bfloat16, the loss and AdamW's state in
    float32): a step's per-token loss is float32's within bfloat16's 8 bits of mantissa, and
    the steps move the weights as float32's do."""
    losses, weights = {}, {}
    for precision in ("32", "bf16"):
        torch.manual_seed(0)
        learner = TorchLearner(GPT(SMALL), nn.CrossEntropyLoss(),
                               functools.partial(torch.optim.AdamW, lr=1e-3),
                               precision=precision, per_position=True)
        learner.setup(_runtime())
        for step in range(3):
            metrics = learner.train_step((_ids(4, 8, seed=10 + step), _ids(4, 8, seed=20 + step)))
        losses[precision] = metrics["loss"][0] / metrics["loss"][1]
        weights[precision] = learner.module.token_embedding.weight.detach().clone()
    assert losses["bf16"] == pytest.approx(losses["32"], rel=2e-2)
    assert weights["bf16"].dtype == torch.float32  # the master weights stay float32
    torch.manual_seed(0)
    moved = (weights["32"] - GPT(SMALL).token_embedding.weight).abs().max()
    assert moved > 1e-3  # AdamW moves each weight by about lr a step
    assert (weights["bf16"] - weights["32"]).abs().max() < 0.1 * moved


@pytest.mark.slow
def test_compile_trains_the_gpt_as_eager_does():
    """`--compile` on torch-gpt: the training forward and backward through torch.compile
    (inductor: the attention, the tied head, the per-token loss) give eager's per-token loss
    and weights to float32 rounding of fused code, and the state keeps the model's own keys."""
    learners, losses = [], []
    for compile in (False, True):
        torch.manual_seed(0)
        learner = TorchLearner(GPT(SMALL), nn.CrossEntropyLoss(),
                               functools.partial(torch.optim.AdamW, lr=1e-3), compile=compile,
                               per_position=True)
        learner.setup(_runtime())
        learners.append(learner)
        losses.append([learner.train_step((_ids(4, 8, seed=10 + step),
                                           _ids(4, 8, seed=20 + step)))["loss"]
                       for step in range(3)])
    eager, compiled = learners
    assert compiled._compile_checked and compiled._train_forward is not compiled._wrapped
    for want, got in zip(*losses):
        assert got[1] == want[1] == 4 * 8  # summed over every token
        assert got[0] == pytest.approx(want[0], rel=1e-5)
    want, got = eager.model_state_dict(), compiled.model_state_dict()
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-5
