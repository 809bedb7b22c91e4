"""Built-in torch models for the 8x8 digits: `dptrain train --model torch-mlp | torch-cnn`.

    from dptrain.learners.recipes import get_recipe, make_learner

    model_factory, loss_fn, optimizer_factory = get_recipe("torch-cnn")
    learner = make_learner("torch-cnn", precision="bf16")   # a TorchLearner, not yet set up

Each recipe is a function returning `(model_factory, loss_fn, optimizer_factory)`. The models
take inputs shaped (B, 64) or (B, 1, 8, 8), as `dptrain.data.load_digits` gives them, and output
(B, 10) logits for `CrossEntropyLoss`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.learners.torch_learner import OptimizerFactory, TorchLearner

NUM_PIXELS = 64
NUM_CLASSES = 10


class Recipe(NamedTuple):
    model_factory: Callable[[], nn.Module]
    """Builds a fresh model; seed torch first for a reproducible initialisation."""
    loss_fn: nn.Module
    optimizer_factory: OptimizerFactory
    """Called with the parameters after wrapping (FSDP replaces them)."""


class Image8x8(nn.Module):
    """(B, 64) or (B, 1, 8, 8) -> (B, 1, 8, 8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 1, 8, 8)


def torch_mlp(*, hidden: int = 128, lr: float = 3e-3, dropout: float = 0.0) -> Recipe:
    """64 -> hidden -> hidden -> 10 with ReLU, Adam; with `dropout` > 0 a Dropout after each
    hidden layer (it draws from torch's global generator, per rank, while training)."""
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")

    def hidden_block(n_in: int) -> list[nn.Module]:
        drop = [nn.Dropout(dropout)] if dropout > 0 else []
        return [nn.Linear(n_in, hidden), nn.ReLU(), *drop]

    def model() -> nn.Module:
        return nn.Sequential(nn.Flatten(), *hidden_block(NUM_PIXELS), *hidden_block(hidden),
                             nn.Linear(hidden, NUM_CLASSES))
    return Recipe(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=lr))


def torch_cnn(*, channels: int = 16, lr: float = 3e-3) -> Recipe:
    """Two 3x3 conv + BatchNorm + ReLU blocks, 2x2 max-pool, linear head; Adam.

    Its BatchNorm layers see only this rank's share of the batch unless the learner is built
    with `sync_batchnorm=True` (which `make_learner` does by default for this recipe).
    """
    def model() -> nn.Module:
        return nn.Sequential(
            Image8x8(),
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels),
            nn.ReLU(), nn.MaxPool2d(2),                                   # (B, 2c, 4, 4)
            nn.Flatten(), nn.Linear(2 * channels * 16, NUM_CLASSES))
    return Recipe(model, nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=lr))


RECIPES: dict[str, Callable[..., Recipe]] = {"torch-mlp": torch_mlp, "torch-cnn": torch_cnn}
# Learner options a recipe needs to train as intended; the caller's options override them.
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {"torch-cnn": {"sync_batchnorm": True}}


def get_recipe(name: str, **kwargs: Any) -> Recipe:
    """The recipe `name` (keywords go to its function, e.g. `lr=1e-3`)."""
    if name not in RECIPES:
        raise ConfigError(f"unknown torch model {name!r}; built-in: {', '.join(sorted(RECIPES))}")
    try:
        return RECIPES[name](**kwargs)
    except TypeError as err:
        raise ConfigError(f"model {name!r}: {err}") from None


def make_learner(name: str, *, recipe_options: dict[str, Any] | None = None,
                 **learner_options: Any) -> TorchLearner:
    """A `TorchLearner` for recipe `name`; `learner_options` are `TorchLearner` keywords."""
    model_factory, loss_fn, optimizer_factory = get_recipe(name, **(recipe_options or {}))
    options = {**DEFAULT_OPTIONS.get(name, {}), **learner_options}
    return TorchLearner(model_factory(), loss_fn, optimizer_factory, **options)
