"""An exponential moving average (EMA) of a module's weights, kept beside the live ones.

    ema = WeightEma(model, decay=0.9998, every=32)
    ema.update(model, step)          # after each optimizer step; averages when step % every == 0
    with ema.swapped_in(model):      # the model computes with the averaged weights meanwhile
        evaluate(model)

Starting from the initial weights, each update is `ema <- decay * ema + (1 - decay) * w` over
every parameter and floating-point buffer (BatchNorm's running statistics, as torchvision's
`ExponentialMovingAverage(use_buffers=True)` averages them); integer buffers (BatchNorm's
step counter) are copied. The averaged tensors have the live tensors' type and placement, so
under FSDP each rank averages its own shards, and they checkpoint (and reshard) with the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class WeightEma:
    def __init__(self, module: nn.Module, *, decay: float, every: int = 1) -> None:
        self.decay, self.every = decay, every
        with torch.no_grad():
            self.state: dict[str, torch.Tensor] = {
                name: t.detach().clone() for name, t in _tensors(module).items()}

    @torch.no_grad()
    def update(self, module: nn.Module, step: int) -> None:
        """Average after optimizer step number `step` (from 1) when it is a multiple of
        `every`: a function of the global step, so a resumed run averages at the same steps."""
        if step % self.every:
            return
        for name, live in _tensors(module).items():
            ema = self.state[name]
            if ema.is_floating_point():
                ema.lerp_(live.detach(), 1.0 - self.decay)
            else:
                ema.copy_(live)

    @contextlib.contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[None]:
        """The averaged weights in `module` for the duration, the live ones back after."""
        live = _tensors(module)
        with torch.no_grad():
            saved = {name: t.detach().clone() for name, t in live.items()}
            for name, t in live.items():
                t.copy_(self.state[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, t in live.items():
                    t.copy_(saved[name])

    def load(self, state: dict[str, torch.Tensor]) -> None:
        missing = self.state.keys() ^ state.keys()
        if missing:
            raise KeyError(f"EMA state does not match the model: {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, t in self.state.items():
                t.copy_(state[name])
