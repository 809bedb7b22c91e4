"""--activation-checkpointing: each GPT block recomputed in the backward, the same numbers."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dptrain.cli.main import main
from dptrain.errors import ConfigError
from dptrain.learners.build import checkpoint_blocks
from dptrain.learners.gpt import GPT, GPTConfig


def _loss_and_grads(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, layers=2, heads=2, width=8,
                          dropout=0.0)).double()
    if checkpointing:
        checkpoint_blocks(model, "torch-gpt")
    calls = []  # runs of the first block's MLP (a module hook is not re-run by a recompute)
    mlp_forward = model.blocks[0].mlp.forward
    model.blocks[0].mlp.forward = lambda x: (calls.append(1), mlp_forward(x))[1]
    ids = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(2))
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


def test_checkpointed_blocks_give_the_same_loss_and_gradients_and_run_twice():
    loss, grads, calls = _loss_and_grads(False)
    loss_ckpt, grads_ckpt, calls_ckpt = _loss_and_grads(True)
    assert (calls, calls_ckpt) == (1, 2)  # recomputed in the backward: it does checkpoint
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-14)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-12, atol=1e-14)


def test_a_model_without_blocks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing: recomputes a model's "
                                          r"blocks; torch-mlp has none"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), "torch-mlp")


@pytest.mark.parametrize("model", ["torch-mlp", "tagi-mlp"])
def test_the_command_line_refuses_it_for_models_without_blocks(model, tmp_path, capsys):
    code = main(["train", "--model", model, "--dataset", "blobs", "--epochs", "1",
                 "--activation-checkpointing", "--nproc", "1", "--no-progress", "--out",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--activation-checkpointing" in err[0], err
