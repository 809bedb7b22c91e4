"""The registry's torch models as ready-made recipes (model, loss, optimizer) for the 8x8 digits.

    from dptrain.learners.recipes import get_recipe, make_learner

    model_factory, loss_fn, optimizer_factory = get_recipe("torch-cnn")
    learner = make_learner("torch-cnn", precision="bf16")   # a TorchLearner, not yet set up

A recipe is a model of `dptrain.models` (the one registry) sized for the digits, with
the loss, optimiser and BatchNorm policy of `dptrain.learners.build`, so it trains as `dptrain
train --model NAME` does. The models take inputs shaped (B, 64) or (B, 1, 8, 8), as
`dptrain.data.load_digits` gives them, and output (B, 10) logits for `CrossEntropyLoss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

from dptrain.errors import ConfigError
from dptrain.learners.build import adam, has_batchnorm, task_loss
from dptrain.models import MODELS, ModelOptions, build_model
from dptrain.learners.torch_config import OptimizerFactory
from dptrain.learners.torch_learner import TorchLearner

DIGITS_SHAPE = (1, 8, 8)
NUM_CLASSES = 10
RECIPES = tuple(name for name, spec in MODELS.items()
                if spec.kind == "torch" and not spec.takes_tokens)
"""The recipe names: the registry's torch models that take images (not the language model)."""


class Recipe(NamedTuple):
    model_factory: Callable[[], nn.Module]
    """Builds a fresh model; seed torch first for a reproducible initialisation."""
    loss_fn: nn.Module
    optimizer_factory: OptimizerFactory
    """Called with the parameters after wrapping (FSDP replaces them)."""


def get_recipe(name: str, *, lr: float = 3e-3, **model_options: Any) -> Recipe:
    """The recipe `name`; `lr` is Adam's, other keywords are `ModelOptions` fields (hidden,
    dropout, width)."""
    if name not in RECIPES:
        raise ConfigError(f"unknown torch model {name!r}; built-in: {', '.join(sorted(RECIPES))}")
    try:
        options = ModelOptions(**model_options)
    except TypeError as err:
        raise ConfigError(f"model {name!r}: {err}") from None
    return Recipe(lambda: build_model(name, DIGITS_SHAPE, NUM_CLASSES, options),
                  task_loss("classification"), adam(lr))


def make_learner(name: str, *, recipe_options: dict[str, Any] | None = None,
                 **learner_options: Any) -> TorchLearner:
    """A `TorchLearner` for recipe `name`; `learner_options` are `TorchLearner` keywords
    (`sync_batchnorm` defaults to whether the model has BatchNorm, as in `dptrain train`)."""
    model_factory, loss_fn, optimizer_factory = get_recipe(name, **(recipe_options or {}))
    model = model_factory()
    options = {"sync_batchnorm": has_batchnorm(model), **learner_options}
    return TorchLearner(model, loss_fn, optimizer_factory, **options)
