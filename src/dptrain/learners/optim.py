"""The optimizer of a torch run: which one, its settings, and which parameters are decayed.

    from dptrain.learners.optim import OptimizerSpec

    spec = OptimizerSpec(name="sgd", lr=0.5, momentum=0.9, nesterov=True, weight_decay=5e-5)
    optimizer = spec.for_module(model)      # two groups: decayed, and norms + biases undecayed

Weight decay on the scale of a normalisation layer or on a bias only pulls the layer towards
zero output without regularising what it computes; torchvision's recipes switch it off there
(`--norm-weight-decay 0`, and `--bias-weight-decay 0` for the newer ones). `param_groups` is
that rule:
a parameter of a normalisation module, or a parameter named `bias`, goes to the group
without decay.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.learners.lars import Lars

OptimizerName = Literal["adam", "adamw", "sgd", "lars"]
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd", "lars")
MOMENTUM_OPTIMIZERS: tuple[str, ...] = ("sgd", "lars")

NORM_CLASSES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm, nn.RMSNorm)
"""What counts as a normalisation layer (torchvision's list, with RMSNorm; dptrain's
AllReduceBatchNorm is a _BatchNorm)."""


def param_groups(module: nn.Module, weight_decay: float, *, decay_norm_and_bias: bool = False
                 ) -> list[dict[str, Any]]:
    """Torch parameter groups of `module`: its trainable parameters with `weight_decay`, and
    unless `decay_norm_and_bias`, the parameters of normalisation layers and those named `bias`
    with none. Each parameter once, in `module.parameters()` order within its group; a group
    left empty is left out."""
    decayed: list[nn.Parameter] = []
    undecayed: list[nn.Parameter] = []
    seen: set[int] = set()
    for owner in module.modules():
        is_norm = isinstance(owner, NORM_CLASSES)
        for name, param in owner.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            excluded = not decay_norm_and_bias and (is_norm or name == "bias")
            (undecayed if excluded else decayed).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": undecayed, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """An optimizer factory: called with parameters (one group) or, through `for_module`, with
    the module (decay groups by `param_groups`). The learner calls `for_module` when the factory
    has it."""

    name: OptimizerName = "adam"
    lr: float = 3e-3
    """The learning rate it starts with (a schedule then sets it every step)."""
    momentum: float = 0.0
    """sgd and lars."""
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    """adam and adamw."""
    weight_decay: float = 0.0
    """Decoupled for adamw (torch's AdamW), L2 added to the gradient for adam, sgd and lars."""
    decay_norm_and_bias: bool = False
    """Decay normalisation weights and biases too (torch's default; off: torchvision's rule)."""

    def __post_init__(self) -> None:
        check_optimizer(self.name, self.momentum, self.nesterov, self.weight_decay)

    def __call__(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        return self._build(params)

    def for_module(self, module: nn.Module) -> torch.optim.Optimizer:
        if not self.weight_decay:
            # One group, as a run made before groups existed: its checkpoints load unchanged.
            return self._build([p for p in module.parameters() if p.requires_grad])
        return self._build(param_groups(module, self.weight_decay,
                                        decay_norm_and_bias=self.decay_norm_and_bias))

    def _build(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        make = {
            "adam": functools.partial(torch.optim.Adam, betas=self.betas,
                                      weight_decay=self.weight_decay),
            "adamw": functools.partial(torch.optim.AdamW, betas=self.betas,
                                       weight_decay=self.weight_decay),
            "sgd": functools.partial(torch.optim.SGD, momentum=self.momentum,
                                     nesterov=self.nesterov, weight_decay=self.weight_decay),
            "lars": functools.partial(Lars, momentum=self.momentum, nesterov=self.nesterov,
                                      weight_decay=self.weight_decay),
        }[self.name]
        return make(params, lr=self.lr)


def check_optimizer(name: str, momentum: float, nesterov: bool, weight_decay: float) -> None:
    """One line for an unknown optimizer or settings it cannot take."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")
    if momentum < 0 or momentum >= 1:
        raise ConfigError(f"momentum: expected a value in [0, 1), got {momentum!r}")
    if momentum and name not in MOMENTUM_OPTIMIZERS:
        raise ConfigError(f"momentum is for optimizer sgd or lars; {name} keeps its own "
                          f"moment estimates (betas)")
    if nesterov and not momentum:
        raise ConfigError("nesterov needs a momentum > 0 (e.g. --momentum 0.9)")
    if weight_decay < 0:
        raise ConfigError(f"weight-decay: expected a value >= 0, got {weight_decay!r}")
