"""Image folders (`--dataset imagefolder:DIR`): the layout, the file list, decoding, ImageNet's
transforms drawn from (seed, epoch, index), and bad data named in one line (contract 6)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dptrain.data import load_dataset
from dptrain.data.config import DataConfig, load_split
from dptrain.data.datasets.image_folder import ImageFolderDataset
from dptrain.data.datasets.image_transforms import ImageTransform, random_crop_box
from dptrain.errors import ConfigError, DataError
from tests._images import write_digits_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_digits_folder(tmp_path_factory.mktemp("digits"), per_class=6)


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def test_the_layout_gives_classes_labels_and_images(folder):
    split = load_dataset(f"imagefolder:{folder}", image_size=16)
    assert (split.num_classes, len(split.train), len(split.test)) == (10, 60, 60)
    assert split.input_shape == (1, 16, 16)  # every image grey: one channel
    files = split.train.files
    assert files.classes == tuple(f"digit{k}" for k in range(10))
    assert files.labels.tolist() == sorted(files.labels.tolist())
    assert files.paths.dtype.kind == "S", "the file list is one byte array, not Python objects"
    x, y = split.train[7]
    assert x.dtype == torch.float32 and y.item() == files.labels[7]
    # the normalisation is estimated on the training images: their pixels come out standard
    pixels = torch.stack([split.train[i][0] for i in range(len(split.train))])
    assert abs(pixels.mean().item()) < 0.05 and abs(pixels.std().item() - 1) < 0.05


def test_mixed_grey_and_colour_is_rgb_and_mean_std_can_be_given(folder, tmp_path):
    root = _copy(folder, tmp_path)
    first = sorted((root / "train" / "digit3").glob("*.png"))[0]
    Image.open(first).convert("RGB").save(first)
    split = load_dataset(f"imagefolder:{root}", image_size=16, mean="0.5", std="0.25")
    assert split.input_shape == (3, 16, 16)
    assert split.x_norm.mean.flatten().tolist() == [127.5] * 3
    with pytest.raises(ConfigError, match="mean and std: give both"):
        load_dataset(f"imagefolder:{root}", mean="0.5")
    with pytest.raises(ConfigError, match="expected 3 values"):
        load_dataset(f"imagefolder:{root}", mean="0.5,0.5", std="0.2")


def test_training_draws_are_a_function_of_seed_epoch_and_index(folder):
    split = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16), seed=3)
    train = split.train
    assert train.transform.train and not split.test.transform.train  # auto: on for folders
    train.set_epoch(2)
    twice = [train[5][0], train[5][0]]
    assert torch.equal(*twice)
    other = ImageFolderDataset(train.files, train.transform, train.channels, train.norm)
    other.set_epoch(2)
    assert torch.equal(other[5][0], twice[0]), "another process draws the same crop"
    other.set_epoch(3)
    assert not torch.equal(other[5][0], twice[0]), "another epoch draws another crop"
    off = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=16,
                                augment="off"), seed=3)
    evaluated = ImageFolderDataset(off.train.files, ImageTransform(16), 1, off.train.norm)
    assert torch.equal(off.train[5][0], evaluated[5][0]), "--no-augment: the evaluation view"


def test_the_random_resized_crop_keeps_to_its_area_and_aspect_ranges():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        left, top, w, h = random_crop_box(120, 80, rng)
        assert 0 <= left and left + w <= 120 and 0 <= top and top + h <= 80
        assert 0.08 * 9600 * 0.9 <= w * h <= 9600 and 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    # an image too narrow for any allowed aspect falls back to the centre crop
    assert random_crop_box(10, 1000, np.random.default_rng(1))[2:] in ((10, 13), (10, 10))


def test_evaluation_resizes_the_short_side_then_crops_the_centre():
    image = Image.fromarray(np.arange(40 * 80, dtype=np.uint8).reshape(40, 80) % 251)
    out = ImageTransform(16).evaluation(image)
    assert out.size == (16, 16)  # short side 40 -> 18 (16 / 0.875), long side 36, centre 16


@pytest.mark.parametrize("damage,message", [
    (lambda r: (r / "train" / "digit4" / "notes.txt").write_text("x"),
     "train/digit4/notes.txt: not an image file"),
    (lambda r: [p.unlink() for p in (r / "train" / "digit2").iterdir()],
     "train/digit2: empty class folder"),
    (lambda r: shutil.move(r / "val" / "digit9", r / "val" / "nine"),
     "the classes of train/ and val/ differ"),
    (lambda r: shutil.rmtree(r / "val"), "expected the folders train/ and val/ (or test/)"),
    (lambda r: (r / "train" / "stray.png").write_bytes(b""), "train/stray.png: not a class"),
    (lambda r: _truncate(sorted((r / "train" / "digit1").glob("*.png"))[0]),
     "train/digit1/0"),
])
def test_bad_folders_are_one_line_naming_the_file(folder, tmp_path, damage, message):
    root = _copy(folder, tmp_path)
    damage(root)
    with pytest.raises(DataError) as info:
        split = load_dataset(f"imagefolder:{root}", image_size=16)
        for i in range(len(split.train)):  # a truncated image fails when it is decoded
            split.train[i]
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:60])


def test_an_empty_or_missing_folder_is_named(tmp_path):
    with pytest.raises(DataError, match="image folder not found"):
        load_dataset(f"imagefolder:{tmp_path / 'nope'}")
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    with pytest.raises(DataError, match="train: no class folders"):
        load_dataset(f"imagefolder:{tmp_path}")
