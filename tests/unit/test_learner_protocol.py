"""The Learner protocol is the whole truth (docs/design.md, The Learner protocol): the Trainer
calls nothing a learner does not declare there, and both learners declare all of it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from dptrain.data import load_digits
from dptrain.runtime import init_distributed
from dptrain.learners import Learner, TorchLearner
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.learners.protocol import Learner as ProtocolClass
from dptrain.train import trainer


def _protocol_members() -> set[str]:
    tree = ast.parse(inspect.getsource(ProtocolClass))
    members = set()
    for node in tree.body[0].body:
        if isinstance(node, ast.FunctionDef):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
    return members


def test_the_trainer_calls_only_what_the_protocol_declares():
    used = {node.attr for node in ast.walk(ast.parse(inspect.getsource(trainer)))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "learner"}
    assert used, "the Trainer calls its learner somewhere: the scan must see it"
    assert used <= _protocol_members(), used - _protocol_members()
    source = inspect.getsource(trainer)
    assert "hasattr(" not in source and "getattr(self.learner" not in source


def test_both_learners_implement_every_member():
    split = load_digits()
    tagi = create_learner(ModelConfig(model="tagi-mlp", hidden=8), LearnerConfig(), split, seed=0)
    torch_ = create_learner(ModelConfig(model="torch-cnn"), LearnerConfig(), load_digits(
        flat=False), seed=0)
    assert isinstance(torch_, TorchLearner)
    for learner in (tagi, torch_):
        assert isinstance(learner, Learner), type(learner).__name__
        missing = {m for m in _protocol_members() if not hasattr(learner, m)}
        assert not missing, (type(learner).__name__, missing)
    assert torch_.config.sync_batchnorm, "a torch model with BatchNorm gets global statistics"
    assert isinstance(torch_.loss_fn, torch.nn.CrossEntropyLoss)


def test_which_learners_take_an_uneven_last_batch():
    """The Trainer's train sampler pads an epoch's last global batch for a learner whose step
    needs equal shards, and splits it unevenly (no repeats, the same steps on any world size)
    for one whose step is the global batch's however it is split."""
    flat, images = load_digits(), load_digits(flat=False)

    def learner(model, split, **options):
        return create_learner(ModelConfig(model=model, hidden=8, width=4),
                              LearnerConfig(**options), split, seed=0)

    assert learner("tagi-mlp", flat).uneven_last_batch  # sum mode
    assert learner("tagi-resnet18", images).uneven_last_batch  # sum mode: global BatchNorm
    assert learner("tagi-mlp", flat, average=True).uneven_last_batch  # 1/N of the sum
    assert not learner("tagi-resnet18", images, average=True).uneven_last_batch  # local BN
    assert not learner("torch-mlp", flat).uneven_last_batch  # DDP: a mean of local means
    split = load_digits()
    config = trainer.TrainConfig(out_dir=Path("unused"), batch_size=4)
    for model, uneven in (("tagi-mlp", True), ("torch-mlp", False)):
        built = trainer.Trainer(learner(model, split), split, config, init_distributed())
        assert built.sampler.uneven_last_batch is uneven, model
