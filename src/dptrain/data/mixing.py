"""Mixup and CutMix over the global batch, drawn from (seed, epoch, position) alone.

    from dptrain.data.mixing import Mixing

    mixing = Mixing(mixup=0.2, cutmix=1.0, num_classes=1000, seed=0)
    plan = mixing.plan(epoch, positions, order, global_batch)   # for this rank's samples
    x, y = mixing.apply(plan, (x, y), (x_partner, y_partner))   # y: (B, K) soft targets

Every sample of an epoch has a global position p (the step's global batch holds positions
step x B to step x B + B - 1, whatever the number of processes: rank r's local slot i is
position i x world size + r). From (seed, epoch, p) alone come the sample's partner, another
position of the same global batch, whether it is mixed by mixup or by cutmix (half each when
both are on), and its weight λ ~ Beta(α, α): so the pairs, and a resumed run's, do not depend
on the world size, and each process fetches its own samples' partners itself (no exchange of
images between processes).

Mixup (Zhang et al. 2018): x = λ x + (1 - λ) x_partner. CutMix (Yun et al. 2019): a box of
area (1 - λ) of the image, centred at a uniform point and clipped to the image, is taken from
the partner, and λ becomes the share of the image left. The target is λ one-hot(y) + (1 - λ)
one-hot(y_partner), for a cross-entropy against class probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dptrain.errors import ConfigError

MIXING_SALT = 0x6D6978  # keeps these draws apart from any other use of (seed, epoch, position)


@dataclass(frozen=True)
class MixPlan:
    """One local batch's draws: per sample the partner's dataset index, λ, and the cutmix box
    (y0, y1, x0, x1; all 0 for mixup)."""

    partners: torch.Tensor  # (b,) int64 dataset indices
    lam: torch.Tensor  # (b,) float64, the drawn weight (mixup) or the share kept (cutmix)
    boxes: torch.Tensor  # (b, 4) int64


@dataclass(frozen=True, kw_only=True)
class Mixing:
    mixup: float = 0.0
    """Beta(α, α) of mixup's weight (0: no mixup)."""
    cutmix: float = 0.0
    """Beta(α, α) of cutmix's weight (0: no cutmix)."""
    num_classes: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mixup < 0 or self.cutmix < 0 or not (self.mixup or self.cutmix):
            raise ConfigError(f"mixup and cutmix: expected alphas >= 0, one of them > 0, got "
                              f"{self.mixup} and {self.cutmix}")

    def plan(self, epoch: int, positions: torch.Tensor, order: torch.Tensor,
             global_batch: int, image_shape: tuple[int, ...] | None = None) -> MixPlan:
        """The draws of the samples at global `positions` of `epoch`, whose epoch order (the
        dataset index at each global position, padding included) is `order`."""
        partners, lams, boxes = [], [], []
        for p in positions.tolist():
            rng = np.random.default_rng([MIXING_SALT, self.seed, epoch, p])
            start = p - p % global_batch
            size = min(global_batch, len(order) - start)  # an epoch's last batch may be short
            offset = int(rng.integers(size - 1)) if size > 1 else -1
            partner = start + (p - start + 1 + offset) % size  # never itself (but alone)
            use_cutmix = self.cutmix > 0 and (self.mixup == 0 or rng.random() < 0.5)
            lam = float(rng.beta(*(2 * [self.cutmix if use_cutmix else self.mixup])))
            box = (0, 0, 0, 0)
            if use_cutmix:
                lam, box = _box(rng, lam, image_shape)
            partners.append(int(order[partner]))
            lams.append(lam)
            boxes.append(box)
        return MixPlan(torch.tensor(partners, dtype=torch.long),
                       torch.tensor(lams, dtype=torch.float64),
                       torch.tensor(boxes, dtype=torch.long).reshape(-1, 4))

    def apply(self, plan: MixPlan, batch: tuple[torch.Tensor, torch.Tensor],
              partner: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixed inputs and their (b, K) class-probability targets."""
        (x, y), (xp, yp) = batch, partner
        lam = plan.lam.to(x.dtype if x.is_floating_point() else torch.float32)
        shape = (-1,) + (1,) * (x.dim() - 1)
        mixed = x * lam.view(shape) + xp * (1 - lam).view(shape)
        for i, (y0, y1, x0, x1) in enumerate(plan.boxes.tolist()):
            if y1 > y0 and x1 > x0:  # cutmix: the box from the partner, the rest unmixed
                mixed[i] = x[i]
                mixed[i, ..., y0:y1, x0:x1] = xp[i, ..., y0:y1, x0:x1]
        eye = torch.eye(self.num_classes, dtype=torch.float32)
        targets = eye[y] * lam[:, None].float() + eye[yp] * (1 - lam)[:, None].float()
        return mixed, targets


def _box(rng: np.random.Generator, lam: float, image_shape: tuple[int, ...] | None
         ) -> tuple[float, tuple[int, int, int, int]]:
    """A box of about (1 - lam) of the image, clipped to it; the share of the image kept."""
    if image_shape is None or len(image_shape) < 2:
        raise ConfigError("cutmix pastes a box of one image into another: it needs image "
                          "inputs (channels, height, width)")
    h, w = image_shape[-2:]
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = int(rng.integers(h)), int(rng.integers(w))
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
    return 1.0 - (y1 - y0) * (x1 - x0) / (h * w), (y0, y1, x0, x1)


def global_positions(local_start: int, local_end: int, rank: int, world_size: int
                     ) -> torch.Tensor:
    """The global positions of this rank's local slots [local_start, local_end)."""
    return torch.arange(local_start, local_end) * world_size + rank
