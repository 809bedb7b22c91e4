"""--activation-checkpointing: each GPT block recomputed in the backward, the same numbers.
The model holds none of it: `dptrain.learners.parallelize` wraps the blocks it declares."""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dptrain.cli.main import main
from dptrain.errors import ConfigError
from dptrain.learners import TorchLearner, parallelize
from dptrain.data import load_dataset
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.models.gpt import GPT, GPTConfig
from dptrain.runtime import DistEnv, Runtime


def _loss_and_grads(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, layers=2, heads=2, width=8,
                          dropout=0.0)).double()
    if checkpointing:
        parallelize.checkpoint_blocks(model, parallelize.model_blocks(model))
    calls = []  # runs of the first block's MLP (a module hook is not re-run by a recompute)
    mlp_forward = model.blocks[0].mlp.forward
    model.blocks[0].mlp.forward = lambda x: (calls.append(1), mlp_forward(x))[1]
    ids = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(2))
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {parallelize.plain_name(n): p.grad.clone()
                           for n, p in model.named_parameters()}, len(calls)


def test_checkpointed_blocks_give_the_same_loss_and_gradients_and_run_twice():
    loss, grads, calls = _loss_and_grads(False)
    loss_ckpt, grads_ckpt, calls_ckpt = _loss_and_grads(True)
    assert (calls, calls_ckpt) == (1, 2)  # recomputed in the backward: it does checkpoint
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-14)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-12, atol=1e-14)


def test_the_blocks_are_wrapped_from_outside_and_keep_their_names():
    """The GPT declares its blocks and nothing more; the wrappers go around them, and state
    dicts keep the plain model's names, so a checkpoint loads with or without them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, layers=2, heads=2, width=8))
    assert not hasattr(model, "activation_checkpointing")
    plain = model.state_dict()
    parallelize.checkpoint_blocks(model, parallelize.model_blocks(model))
    assert [type(b).__name__ for b in model.blocks] == ["CheckpointWrapper"] * 2
    assert model.state_dict().keys() == plain.keys()
    ids = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # evaluation runs the blocks as they are
        fresh = GPT(GPTConfig(vocab_size=11, block_size=8, layers=2, heads=2, width=8))
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(model.eval()(ids), fresh.eval()(ids))


def test_a_model_without_blocks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing: recomputes a model's "
                                          r"blocks; torch-mlp has none"):
        create_learner(ModelConfig(model="torch-mlp"),
                       LearnerConfig(activation_checkpointing=True), load_dataset("blobs"),
                       seed=0)


@pytest.mark.parametrize("model", ["torch-mlp", "tagi-mlp"])
def test_the_command_line_refuses_it_for_models_without_blocks(model, tmp_path, capsys):
    code = main(["train", "--model", model, "--dataset", "blobs", "--epochs", "1",
                 "--activation-checkpointing", "--nproc", "1", "--no-progress", "--out",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--activation-checkpointing" in err[0], err


def _runtime() -> Runtime:
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                  master_addr="127.0.0.1", master_port=0, launcher="single")
    return Runtime(env, "gloo", torch.device("cpu"), timedelta(seconds=30))


def _trained(checkpointing: bool) -> TorchLearner:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, layers=2, heads=2, width=8,
                          dropout=0.1)).double()
    learner = TorchLearner(model, nn.CrossEntropyLoss(),
                           functools.partial(torch.optim.AdamW, lr=1e-2), per_position=True,
                           activation_checkpointing=checkpointing, ema_decay=0.5)
    learner.setup(_runtime())
    for step in range(2):
        ids, targets = (torch.randint(0, 11, (3, 8),
                                      generator=torch.Generator().manual_seed(10 * step + k))
                        for k in (1, 2))
        learner.train_step((ids, targets))
    return learner


def test_the_learner_checkpoints_the_blocks_and_its_state_resumes_without():
    """`activation_checkpointing=True`: the learner wraps the blocks at setup; with dropout
    (its masks drawn again, the same, in the recompute) two steps give the plain learner's
    weights and averages, under the same names, and its state loads into a plain learner."""
    plain, checkpointed = _trained(False), _trained(True)
    assert type(checkpointed.module.blocks[0]).__name__ == "CheckpointWrapper"
    for want, got in ((plain.model_state_dict(), checkpointed.model_state_dict()),
                      (plain.ema_state_dict(), checkpointed.ema_state_dict())):
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14)
    resumed = _trained(False)
    resumed.load_state_dict(checkpointed.state_dict())
    assert resumed.num_optimizer_steps == 2
    assert all(torch.equal(resumed.ema_state_dict()[k], v)
               for k, v in checkpointed.ema_state_dict().items())
