"""Image folders in torchvision's `ImageFolder` layout, decoded lazily, one sample at a time.

    DIR/train/<class>/*.jpg|jpeg|png|webp
    DIR/val/<class>/...          (or DIR/test/): the layout ImageNet comes in once its
                                 validation images are moved into class folders
    DIR/test/<class>/...         with val/ too: val/ validates (chooses the best epoch) and
                                 test/ tests; with one of them alone, it is the test part

Class ids follow the sorted class folder names, which must be the same in both parts. The file
list is the only thing kept in memory: relative paths in one numpy byte array and int64 labels
(about the path's length plus 8 bytes per image, and no Python object per image, which would
cost ten times that: each DataLoader worker holds one copy). Images are grey (1 channel) when every image is grey,
else RGB; each is decoded when a batch needs it, transformed (`image_transforms`), and
normalised per channel. Every process builds the list itself by scanning the folder (sorted,
so the same everywhere; `fingerprint` lets a job check that its nodes see the same files).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import get_worker_info

from dptrain.data.datasets.base import Batch, Normalisation, Skipped, Split
from dptrain.data.datasets.image_transforms import ImageTransform
from dptrain.errors import ConfigError, DataError

SUFFIXES = (".jpeg", ".jpg", ".png", ".webp")
TEST_PARTS = ("val", "test")
NORM_SAMPLE = 512
"""Training images (a seeded sample) whose pixels estimate the per-channel mean and std."""
GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")


@dataclass(frozen=True, eq=False)
class FileList:
    """One part's images: `root`-relative paths (bytes) and class ids, in the sorted order."""

    root: Path
    paths: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, i: int) -> Path:
        return self.root / os.fsdecode(self.paths[i])

    def fingerprint(self) -> str:
        digest = hashlib.sha256("\n".join(self.classes).encode())
        digest.update(b"\0".join(self.paths.tolist()))
        return digest.hexdigest()


def scan(part: Path) -> FileList:
    """The images of `part`, class folder by class folder; anything that is not an image of a
    class folder is a one-line DataError naming it."""
    try:
        entries = sorted((e for e in os.scandir(part) if not e.name.startswith(".")),
                         key=lambda e: e.name)
    except OSError as err:
        raise DataError(f"{part}: cannot list it: {err.strerror or err}") from None
    strays = [e.name for e in entries if not e.is_dir()]
    if strays:
        raise DataError(f"{part}/{strays[0]}: not a class folder (images go in "
                        f"{part}/<class>/)")
    classes = tuple(e.name for e in entries)
    if not classes:
        raise DataError(f"{part}: no class folders in it (expected {part}/<class>/<images>)")
    paths, labels = [], []  # one array per class folder: only one folder's str objects live
    for label, name in enumerate(classes):
        files = sorted(f.name for f in os.scandir(part / name) if not f.name.startswith("."))
        if not files:
            raise DataError(f"{part / name}: empty class folder")
        for file in files:
            if not file.lower().endswith(SUFFIXES):
                raise DataError(f"{part / name / file}: not an image file (accepted: "
                                f"{', '.join(SUFFIXES)})")
        paths.append(np.array([os.fsencode(f"{name}/{file}") for file in files],
                              dtype=np.bytes_))
        labels.append(np.full(len(files), label, dtype=np.int64))
    return FileList(part, np.concatenate(paths), np.concatenate(labels), classes)


def decode(path: Path, channels: int) -> Image.Image:
    """The image at `path` as grey (1 channel) or RGB (3), fully read; a DataError naming the
    file when it cannot be."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("L" if channels == 1 else "RGB")
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise DataError(f"{path}: not a readable image ({err})") from None


def is_grey(files: FileList, skip_bad: bool = False) -> bool:
    """True when every (readable) image's header says grey (no pixel is decoded)."""
    for i in range(len(files)):
        try:
            with Image.open(files.path(i)) as image:
                if image.mode not in GREY_MODES:
                    return False
        except (OSError, UnidentifiedImageError) as err:
            if not skip_bad:
                raise DataError(f"{files.path(i)}: not a readable image ({err})") from None
    return True


class ImageFolderDataset(torch.utils.data.Dataset):
    """`dataset[i]` -> (image (C, S, S) float32 normalised, class id): decoded on demand. With
    `skip_bad`, an image that cannot be decoded gives a `Skipped` item (naming the file)
    instead of raising; the loader leaves it out of its batch and counts it."""

    def __init__(self, files: FileList, transform: ImageTransform, channels: int,
                 norm: Normalisation, *, skip_bad: bool = False) -> None:
        self.files, self.transform, self.channels, self.norm = files, transform, channels, norm
        self.skip_bad = skip_bad
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.files)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return (self.channels, self.transform.size, self.transform.size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation draws the next samples use."""
        self.epoch = epoch

    def with_augmentation(self, *, seed: int) -> ImageFolderDataset:
        """The same images through the training transform (random resized crop and flip)."""
        return ImageFolderDataset(self.files, replace(self.transform, train=True, seed=seed),
                                  self.channels, self.norm, skip_bad=self.skip_bad)

    def _image(self, i: int) -> np.ndarray:
        """Image i after its transform: (C, S, S) uint8, contiguous."""
        image = self.transform(decode(self.files.path(i), self.channels), i, self.epoch)
        array = np.asarray(image)
        return np.ascontiguousarray(array.reshape(*array.shape[:2], -1).transpose(2, 0, 1))

    def pixels(self, i: int) -> torch.Tensor:
        """Image i after its transform, (C, S, S) float32 in raw pixel units (0-255)."""
        return torch.from_numpy(self._image(i).astype(np.float32))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | Skipped:
        batch = self.batch([i], shared=False)
        if batch.skipped:
            return Skipped(batch.skipped[0])
        x, y = batch
        return x[0], y[0]

    def batch(self, indices, *, shared: bool | None = None) -> Batch:
        """The samples `indices` stacked, as default_collate stacks `dataset[i]`: (B, C, S, S)
        float32 and (B,) class ids. Each image is normalised straight into its row of the
        batch: no tensor per image and no stacking copy. `shared`: the batch in shared memory
        (default: inside a DataLoader worker, as default_collate does), so it reaches the
        training process without another copy. With `skip_bad`, images that cannot be decoded
        are left out and named in the batch's `skipped`.

        The normalisation, `norm.apply`'s arithmetic with the same bits, is numpy's: it runs on
        this thread, whereas each torch op would wake the intra-op threads for every image (a
        training process decoding with --workers 0 has several; on a busy machine they spin)."""
        idx = [int(i) for i in indices]
        x = _empty((len(idx), *self.sample_shape),
                   get_worker_info() is not None if shared is None else shared)
        rows = x.numpy()
        mean, std = self.norm.mean.numpy(), self.norm.std.numpy()
        dtype = np.promote_types(np.float32, mean.dtype)
        kept, skipped = [], []
        for row, i in zip(rows, idx):
            try:
                image = self._image(i)
            except DataError as err:
                if not self.skip_bad:
                    raise
                skipped.append(str(err))
                continue
            np.divide(np.subtract(image, mean, dtype=dtype), std, out=row, casting="same_kind")
            kept.append(len(kept) + len(skipped))
        labels = torch.from_numpy(self.files.labels[idx])
        if skipped:  # rare: a copy of the rows that were filled
            x, labels = x[kept], labels[kept]
        batch = Batch((x, labels))
        batch.skipped = tuple(skipped)
        return batch

    def __repr__(self) -> str:
        kind = "crop+flip" if self.transform.train else "resize+centre crop"
        return (f"ImageFolderDataset({str(self.files.root)!r}, {len(self)} images, "
                f"{self.sample_shape}, {kind})")


def _empty(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """An uninitialised float32 tensor, in shared memory if `shared` (the storage that torch's
    default_collate makes in a worker; ordinary memory where this torch lacks it)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None) if shared else None
    if new_shared is None:
        return torch.empty(shape)
    return torch.empty(0).set_(new_shared(4 * math.prod(shape)), 0, shape)


def estimate_normalisation(dataset: ImageFolderDataset, seed: int = 0) -> Normalisation:
    """Per-channel mean and std of the pixels of a seeded sample of `dataset`, in float64."""
    count = min(NORM_SAMPLE, len(dataset))
    picked = np.random.default_rng(seed).choice(len(dataset), size=count, replace=False)
    total = sq = torch.zeros(dataset.channels, dtype=torch.float64)
    for i in sorted(picked.tolist()):
        try:
            pixels = dataset.pixels(i).to(torch.float64).flatten(1)
        except DataError:
            if not dataset.skip_bad:
                raise
            count -= 1
            continue
        total, sq = total + pixels.sum(1), sq + (pixels * pixels).sum(1)
    if count == 0:
        raise DataError(f"{dataset.files.root}: none of the images sampled for the "
                        f"normalisation could be decoded")
    n = count * dataset.transform.size ** 2
    mean = total / n
    std = (sq / n - mean * mean).clamp_min(0).sqrt()
    std = torch.where(std > 0, std, torch.ones_like(std))
    return Normalisation(mean.float()[:, None, None], std.float()[:, None, None])


def _parse_channels(text: str, channels: int, name: str) -> torch.Tensor:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{name}: expected {channels} comma-separated numbers, got "
                          f"{text!r}") from None
    if len(values) == 1:
        values *= channels
    if len(values) != channels:
        raise ConfigError(f"{name}: expected {channels} values (one per channel), got "
                          f"{text!r}")
    return torch.tensor(values, dtype=torch.float32)[:, None, None] * 255.0


def load_image_folder(directory: str | Path, *, image_size: int = 224, mean: str = "",
                      std: str = "", bad_images: str = "error") -> Split:
    """An image-folder split (see the module docstring), both parts with the evaluation
    transform; `Split.train.with_augmentation(seed)` gives the training one. `mean` and `std`
    (per channel, of 0-1 pixel values as torchvision's `Normalize` takes them, comma-separated)
    replace the estimate from the training images. `bad_images="skip"` leaves images that
    cannot be decoded out of their batches (counted in the run's summary) instead of stopping
    the run with an error naming the first."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    if bad_images not in ("error", "skip"):
        raise ConfigError(f"bad-images: expected error or skip, got {bad_images!r}")
    if image_size < 1:
        raise ConfigError(f"image-size: expected an integer >= 1, got {image_size}")
    held = [root / p for p in TEST_PARTS if (root / p).is_dir()]
    if not (root / "train").is_dir() or not held:
        raise DataError(f"{root}: expected the folders train/ and val/ (or test/), each with "
                        f"one folder of images per class")
    train, test = scan(root / "train"), scan(held[-1])
    val = scan(held[0]) if len(held) == 2 else None
    for part, files in ((held[-1], test), *(((held[0], val),) if val is not None else ())):
        if train.classes != files.classes:
            only = sorted(set(train.classes) ^ set(files.classes))
            raise DataError(f"{root}: the classes of train/ and {part.name}/ differ "
                            f"({len(train.classes)} vs {len(files.classes)}; in one only: "
                            f"{', '.join(only[:5]) or 'the order'})")
    skip_bad = bad_images == "skip"
    channels = 1 if all(is_grey(files, skip_bad) for files in (train, test, val)
                        if files is not None) else 3
    evaluation, skip = ImageTransform(image_size), bad_images == "skip"
    unit = Normalisation(torch.zeros(channels, 1, 1), torch.ones(channels, 1, 1))
    if bool(mean) != bool(std):
        raise ConfigError("mean and std: give both (per channel, of 0-1 pixel values), or "
                          "neither to estimate them from the training images")
    if mean:
        norm = Normalisation(_parse_channels(mean, channels, "mean"),
                             _parse_channels(std, channels, "std"))
    else:
        norm = estimate_normalisation(ImageFolderDataset(train, evaluation, channels, unit,
                                                         skip_bad=skip))
    validation = None if val is None else \
        ImageFolderDataset(val, evaluation, channels, norm, skip_bad=skip)
    return Split(name="imagefolder", task="classification", num_classes=len(train.classes),
                 x_norm=norm, augment_by_default=True,
                 train=ImageFolderDataset(train, evaluation, channels, norm, skip_bad=skip),
                 test=ImageFolderDataset(test, evaluation, channels, norm, skip_bad=skip),
                 validation=validation,
                 fingerprint=":".join(files.fingerprint() for files in (train, test, val)
                                      if files is not None))
