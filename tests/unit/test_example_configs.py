"""The recipe files in examples/configs parse as `dptrain train --config` reads them and build
the learner they describe, with the published settings they cite (not trained here: ImageNet
is not on this machine). The data is a stand-in of the real set's size and image shape."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dptrain.cli.train import resolve
from dptrain.data.datasets.base import Split
from dptrain.runtime import init_distributed
from dptrain.learners.build import RunLength, create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


class StandIn(torch.utils.data.Dataset):
    """`length` samples of `shape` (never read: building needs the size and shape only)."""

    def __init__(self, length: int, shape: tuple[int, ...]) -> None:
        self.length, self.sample_shape = length, shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.sample_shape), torch.tensor(0)


def _built(name: str, num_train: int, shape: tuple[int, ...], num_classes: int):
    options = resolve({}, str(CONFIGS / name))
    split = Split(name=name, train=StandIn(num_train, shape), test=StandIn(10, shape),
                  task="classification", num_classes=num_classes)
    learner = create_learner(options.part(ModelConfig), options.part(LearnerConfig), split,
                             seed=0, run=RunLength(options.batch_size, options.epochs))
    learner.setup(init_distributed())
    return options, learner


def test_every_recipe_file_is_tested_here():
    assert sorted(p.name for p in CONFIGS.glob("*.toml")) == [
        "large_batch_digits.toml", "resnet18_cifar10.toml", "resnet50_imagenet.toml",
        "resnet50_imagenet_v1.toml"]


def test_torchvisions_resnet50_recipe_builds_with_its_published_settings():
    options, learner = _built("resnet50_imagenet.toml", 1_281_167, (3, 224, 224), 1000)
    per_epoch = math.ceil(1_281_167 / 1024)
    optimizer, schedule = learner.optimizer, learner.config.lr_schedule
    assert isinstance(optimizer, torch.optim.SGD)
    groups = optimizer.param_groups
    assert [(g["weight_decay"], g["momentum"], g["nesterov"]) for g in groups] == \
        [(2e-5, 0.9, False), (0.0, 0.9, False)]
    assert sum(p.numel() for g in groups for p in g["params"]) == 25_557_032  # torchvision's
    assert (schedule.kind, schedule.peak, schedule.warmup_steps, schedule.total_steps) == \
        ("cosine", 0.5, 5 * per_epoch, 600 * per_epoch)
    assert schedule.lr(0) == pytest.approx(0.005) and schedule.min_lr == 0.0
    assert learner.loss_fn.label_smoothing == 0.1
    assert (learner.ema.decay, learner.ema.every) == (0.99891, 32)
    assert (options.mixup, options.cutmix) == (0.2, 1.0)
    assert options.model == "torch-resnet50" and options.image_size == 224


def test_the_original_resnet50_recipe_maps_entirely():
    options, learner = _built("resnet50_imagenet_v1.toml", 1_281_167, (3, 224, 224), 1000)
    per_epoch = math.ceil(1_281_167 / 256)
    (group,) = learner.optimizer.param_groups  # decay on everything, as train.py did then
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 1e-4)
    schedule = learner.config.lr_schedule
    assert (schedule.kind, schedule.step_size, schedule.decay) == ("step", 30 * per_epoch, 0.1)
    assert schedule.lr(30 * per_epoch) == pytest.approx(0.01)
    assert schedule.lr(60 * per_epoch) == schedule.lr(90 * per_epoch - 1) == pytest.approx(1e-3)
    # Goyal et al.'s large batch from the same file: batch 8192, lr scaled to 3.2.
    large = resolve({"batch_size": 8192, "warmup": 5.0}, str(CONFIGS /
                                                             "resnet50_imagenet_v1.toml"))
    from dptrain.learners.build import peak_lr
    assert peak_lr(large.part(LearnerConfig), large.batch_size) == pytest.approx(3.2)


def test_the_cifar_resnet18_recipe_builds():
    options, learner = _built("resnet18_cifar10.toml", 50_000, (3, 32, 32), 10)
    groups = learner.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]
    schedule = learner.config.lr_schedule
    assert (schedule.peak, schedule.warmup_steps, schedule.total_steps) == \
        (0.1, 391, 200 * 391)
    assert options.augment == "on" and learner.config.sync_batchnorm


def test_the_large_batch_benchmarks_recipe_builds():
    """bench/distributed/large_batch.py's large batch: 60,000 images at 512, 118 steps per epoch."""
    _, learner = _built("large_batch_digits.toml", 60_000, (1, 28, 28), 10)
    schedule = learner.config.lr_schedule
    assert (schedule.peak, schedule.warmup_steps, schedule.milestones, schedule.total_steps) == \
        (0.2, 118, (354, 708, 944), 1062)
    assert isinstance(learner.optimizer, torch.optim.SGD)
