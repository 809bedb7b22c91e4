"""The random stream for parameter initialisation (pytagi's `manual_seed`)."""

from __future__ import annotations

import torch

_generator: torch.Generator | None = None


def manual_seed(seed: int) -> None:
    """Seed the stream every later layer construction draws its initial means from.

    Until this is called, draws come from torch's global generator (so `torch.manual_seed`
    works too). Layers draw weights, then biases, in construction order.
    """
    global _generator
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    _generator = generator


def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """float64 CPU draws from N(0, std²)."""
    return torch.randn(shape, generator=_generator, dtype=torch.float64).mul_(std)
