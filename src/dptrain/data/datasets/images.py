"""Image datasets kept as uint8 in memory, normalised (and augmented) one batch at a time.

CIFAR-10 as float32 is 600 MB per process; as uint8 it is 150 MB. `ImageDataset[idx]` returns
float32 inputs normalised with the split's `x_norm`, exactly what an `ArrayDataset` of
pre-normalised floats would return.

Augmentation (`with_augmentation(seed)`, training images only): a random crop of the image
padded by 4 black pixels (raw value 0, before normalisation) on each side, and a horizontal flip
with probability 1/2. The draws of sample i in epoch e are a hash of (seed, e, i), not of an
RNG stream, so they do not depend on which rank reads the sample, on the batch it falls in, or on
whether the run was interrupted and resumed: every world size and every resumed run sees the
same images.
"""

from __future__ import annotations

import numpy as np
import torch

from dptrain.data.datasets.base import ArrayDataset, Normalisation, Split

PAD = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose output bits all depend on the input."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_keys(seed: int, epoch: int, indices: torch.Tensor | np.ndarray) -> np.ndarray:
    """A 64-bit hash of (seed, epoch, index) per sample: what every random draw of a sample's
    augmentation derives from, so draws depend on nothing else (rank, batch, worker, resume)."""
    idx = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices
                     ).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
                     + np.uint64(epoch & 0xFFFFFFFF))
        return _mix64(key ^ _mix64(idx + np.uint64(0x632BE59BD9B4E019)))


def augmentation_draws(seed: int, epoch: int, indices: torch.Tensor, pad: int = PAD
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, dx, flip) per sample: crop offsets in [0, 2·pad] and a flip flag, from the hash of
    (seed, epoch, index)."""
    h = draw_keys(seed, epoch, indices)
    span = np.uint64(2 * pad + 1)
    dy = (h % span).astype(np.int64)
    dx = ((h >> np.uint64(16)) % span).astype(np.int64)
    flip = ((h >> np.uint64(32)) & np.uint64(1)).astype(bool)
    return torch.from_numpy(dy), torch.from_numpy(dx), torch.from_numpy(flip)


def crop_flip(raw: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor,
              pad: int = PAD) -> torch.Tensor:
    """Images (B, C, H, W) padded by `pad` zeros, cropped at (dy, dx) to (H, W), then flipped
    left-right where `flip`: one gather for the whole batch."""
    b, c, h, w = raw.shape
    padded = torch.nn.functional.pad(raw, (pad, pad, pad, pad))
    cols = torch.arange(w)
    cols = torch.where(flip[:, None], w - 1 - cols, cols) + dx[:, None]    # (B, W)
    rows = torch.arange(h) + dy[:, None]                                    # (B, H)
    return padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


class ImageDataset(ArrayDataset):
    """Raw uint8 images `raw` (N, ...) and targets `y`; items are normalised float32.

    `x` (the whole set normalised, computed on demand) is there for code that wants every input
    at once; training reads batches through `dataset[idx]`.
    """

    def __init__(self, raw: torch.Tensor, y: torch.Tensor, norm: Normalisation, *,
                 augment_seed: int | None = None) -> None:
        if raw.dtype != torch.uint8:
            raise TypeError(f"ImageDataset keeps uint8 pixels, got {raw.dtype}")
        if augment_seed is not None and raw.ndim != 4:
            raise ValueError(f"augmentation needs images (N, C, H, W), got {tuple(raw.shape)}")
        super().__init__(raw, y)  # its `self.x = raw` lands in the setter: `self.raw`
        self.raw, self.norm, self.augment_seed, self.epoch = raw, norm, augment_seed, 0

    @property
    def x(self) -> torch.Tensor:  # type: ignore[override]
        return self.norm.apply(self.raw.float()).float()

    @x.setter
    def x(self, value: torch.Tensor) -> None:
        self.raw = value

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.raw.shape[1:])

    def __len__(self) -> int:
        return self.raw.shape[0]

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation draws the next batches use."""
        self.epoch = epoch

    def with_augmentation(self, *, seed: int) -> ImageDataset:
        """The same images, randomly cropped and flipped (see the module docstring)."""
        return ImageDataset(self.raw, self.y, self.norm, augment_seed=seed)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            idx = torch.arange(len(self))[idx]
        single = isinstance(idx, (int, np.integer)) or (isinstance(idx, torch.Tensor)
                                                        and idx.ndim == 0)
        index = torch.as_tensor(idx).reshape(-1)
        raw = self.raw[index]
        if self.augment_seed is not None:
            raw = crop_flip(raw, *augmentation_draws(self.augment_seed, self.epoch, index))
        x = self.norm.apply(raw.float()).float()
        y = self.y[index]
        return (x[0], y[0]) if single else (x, y)

    def __repr__(self) -> str:
        aug = ", crop+flip" if self.augment_seed is not None else ""
        return f"ImageDataset(raw={tuple(self.raw.shape)} uint8, y={tuple(self.y.shape)}{aug})"


def fit_image_normalisation(raw: torch.Tensor, dim: tuple[int, ...],
                            chunk: int = 1024) -> Normalisation:
    """Mean and std of uint8 `raw` over `dim` (which includes the sample axis 0), summed in
    float64 chunks (25 MB for CIFAR-10) so no float copy of the whole set is ever made; float32
    stats like `Normalisation.fit`."""
    total = sq = torch.zeros((), dtype=torch.float64)
    count = 0
    for start in range(0, raw.shape[0], chunk):
        part = raw[start:start + chunk].to(torch.float64)
        part_sum = part.sum(dim=dim, keepdim=True)
        total = total + part_sum
        sq = sq + (part * part).sum(dim=dim, keepdim=True)
        count += part.numel() // part_sum.numel()  # values per statistic in this chunk
    mean = total / count
    var = (sq / count - mean * mean).clamp_min(0)
    std = var.sqrt()
    std = torch.where(std > 0, std, torch.ones_like(std))
    return Normalisation(mean.squeeze(0).float(), std.squeeze(0).float())


def image_classification_split(name: str, x_train: torch.Tensor, y_train: torch.Tensor,
                               x_test: torch.Tensor, y_test: torch.Tensor, num_classes: int,
                               x_norm: Normalisation, augment_by_default: bool = False
                               ) -> Split:
    """Like `classification_split` for uint8 images, which stay uint8 in memory and are
    normalised with `x_norm` one batch at a time (see `ImageDataset`)."""
    return Split(name=name, task="classification", num_classes=num_classes, x_norm=x_norm,
                 augment_by_default=augment_by_default,
                 train=ImageDataset(x_train, y_train.long(), x_norm),
                 test=ImageDataset(x_test, y_test.long(), x_norm))
