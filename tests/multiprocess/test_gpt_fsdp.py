"""torch-gpt under FSDP2: each block its own unit, then the root (which holds the embeddings
and the output layer tied to them), with or without activation checkpointing; sharded
checkpoints written on 2 ranks in the background (as the Trainer writes them, while a further
step changes the weights) resume on 1 and back on 2, in float64 as a run that never stopped,
and the tie survives every round trip."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch

from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.learners import TorchLearner
from dptrain.learners.build import task_loss
from dptrain.models.gpt import GPT, GPTConfig
from dptrain.runtime import init_distributed, resolve_env
from tests._world import run_world
from tests.multiprocess.test_torch_learner import _runtime

pytestmark = pytest.mark.dist

TEXT = "first citizen: before we proceed any further, hear me speak.\n" * 3
VOCAB = Vocabulary.from_text(TEXT)
IDS = VOCAB.encode(TEXT, where="test")
BLOCK, BATCH = 8, 4
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH windows of the text at seeded starts, targets shifted by one."""
    starts = torch.randint(0, len(IDS) - BLOCK - 1, (BATCH,),
                           generator=torch.Generator().manual_seed(100 + step))
    x = torch.stack([IDS[s:s + BLOCK] for s in starts])
    return x, torch.stack([IDS[s + 1:s + BLOCK + 1] for s in starts])


def _learner(strategy: str, seed: int = 0, checkpointing: bool = False) -> TorchLearner:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB.size, block_size=BLOCK, layers=1, heads=2,
                          width=8)).double()
    return TorchLearner(model, task_loss("classification"), ADAMW, strategy=strategy,
                        max_grad_norm=1.0, per_position=True,
                        activation_checkpointing=checkpointing)


def _train(learner: TorchLearner, steps, rank: int, world_size: int) -> None:
    share = BATCH // world_size
    for s in steps:
        x, y = _batch(s)
        learner.train_step((x[rank * share:(rank + 1) * share],
                            y[rank * share:(rank + 1) * share]))


def _tied(learner: TorchLearner) -> bool:
    gpt = learner.module
    return gpt.head.weight is gpt.token_embedding.weight


def _phase(rank: int, world_size: int, load: str | None, save: str, steps: list[int],
           seed: int, checkpointing: bool = False, after: tuple[int, ...] = ()) -> dict:
    """A fresh learner (initialised from `seed`) restores `load`, trains `steps`, saves in the
    background and trains `after` while the shards may still be written (the checkpoint must
    hold the weights of the save); `checkpointing`: with the blocks recomputed in the backward
    (--activation-checkpointing), which must change nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learner = _learner("fsdp", seed, checkpointing)
        learner.setup(_runtime(rank, world_size))
        # each block its FSDP unit; with checkpointing, the unit is the block's wrapper
        units = [(type(b).__name__, type(getattr(b, "_checkpoint_wrapped_module", b)).__name__)
                 for b in learner.module.blocks]
        if load:
            learner.load_sharded(Path(load) / "sharded")
        _train(learner, steps, rank, world_size)
        learner.save_checkpoint(Path(save), background=True)
        _train(learner, after, rank, world_size)
        learner.checkpoint_written()
        return {"units": units, "root": type(learner.module).__name__, "tied": _tied(learner),
                "state": learner.model_state_dict()}


def _one_process(load: str, save: str, steps: list[int]) -> dict:
    learner = _learner("fsdp", seed=7)
    learner.setup(init_distributed(resolve_env({})))
    learner.load_sharded(Path(load) / "sharded")
    _train(learner, steps, 0, 1)
    learner.save_checkpoint(Path(save), background=True)  # one process: written here
    return {"tied": _tied(learner), "state": learner.model_state_dict()}


def _relative_gap(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item()
               for k in theirs)


def test_gpt_blocks_shard_and_resume_2_to_1_to_2_processes_as_if_never_stopped(tmp_path):
    first, second = str(tmp_path / "after2"), str(tmp_path / "after4")
    started = run_world(_phase, None, first, [0, 1], 0, True, (2,), world_size=2,
                        timeout_s=120)
    for rank, r in enumerate(started):
        assert r["units"] == [("FSDPCheckpointWrapper", "Block")] and r["root"] == "FSDPGPT", \
            f"rank {rank}: {r}"
        assert r["tied"], f"rank {rank}: the output layer lost the embedding's weight"
    middle = _one_process(first, second, [2, 3])
    assert middle["tied"]
    ended = run_world(_phase, second, str(tmp_path / "after6"), [4, 5], 5, world_size=2,
                      timeout_s=120)

    reference = _learner("ddp")
    reference.setup(init_distributed(resolve_env({})))
    _train(reference, range(6), 0, 1)
    want = reference.model_state_dict()
    for rank, r in enumerate(ended):
        assert r["tied"], f"rank {rank}"
        state = r["state"]
        assert torch.equal(state["head.weight"], state["token_embedding.weight"])
        gap = _relative_gap(state, want)
        assert gap < 1e-12, f"rank {rank}: {gap:.3g}"
    assert torch.equal(ended[0]["state"]["blocks.0.mlp.fc.weight"],
                       ended[1]["state"]["blocks.0.mlp.fc.weight"])
    # the phases did move the weights: a resume that restored nothing would not match
    assert _relative_gap(started[0]["state"], want) > 1e-4
