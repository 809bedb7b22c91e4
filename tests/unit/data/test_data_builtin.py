"""Built-in datasets, the containers, and the `load_dataset` spellings the CLI passes on."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

import dptrain.data
from dptrain.data import ArrayDataset, Split, accepted_names, load_dataset
from dptrain.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def digits() -> Split:
    return load_dataset("digits")


def test_digits_split_and_scaling_are_what_the_tagi_tests_use(digits):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(bunch.data, bunch.target, test_size=360,
                                              stratify=bunch.target, random_state=0)
    mean = (x_tr / 16).mean(axis=0)
    assert (len(digits.train), len(digits.test)) == (1437, 360)
    assert digits.input_shape == (64,) and digits.num_classes == 10 == digits.output_dim
    np.testing.assert_allclose(digits.train.x.numpy(), x_tr / 16 - mean, atol=1e-6)
    np.testing.assert_allclose(digits.test.x.numpy(), x_te / 16 - mean, atol=1e-6)
    assert digits.train.y.tolist() == y_tr.tolist() and digits.test.y.dtype == torch.int64
    assert torch.bincount(digits.test.y).tolist() == np.bincount(y_te).tolist()  # stratified
    raw = torch.from_numpy(x_te).float()
    torch.testing.assert_close(digits.x_norm.apply(raw), digits.test.x, atol=1e-6, rtol=0)


def test_digits_image_holds_the_same_values_as_1x8x8(digits):
    image = load_dataset("digits-image")
    assert image.input_shape == (1, 8, 8) and image.train.x.dtype == torch.float32
    assert torch.equal(image.train.x.reshape(-1, 64), digits.train.x)
    assert torch.equal(image.test.y, digits.test.y)


def test_diabetes_is_standardised_with_training_statistics():
    from sklearn.datasets import load_diabetes

    split = load_dataset("diabetes")
    assert (len(split.train), len(split.test)) == (353, 89)
    assert split.task == "regression" and split.num_classes is None
    assert split.input_shape == (10,) and split.train.y.shape == (353, 1)
    torch.testing.assert_close(split.train.x.mean(0), torch.zeros(10), atol=1e-5, rtol=0)
    torch.testing.assert_close(split.train.x.std(0, correction=0), torch.ones(10), atol=1e-5,
                               rtol=0)
    assert abs(split.test.x.mean().item()) > 1e-4  # test stats were not used
    raw_y = split.y_norm.invert(torch.cat([split.train.y, split.test.y])).squeeze(1)
    target = torch.from_numpy(load_diabetes().target).float()
    torch.testing.assert_close(raw_y.sort().values, target.sort().values, atol=1e-3, rtol=0)
    assert split.y_norm.invert(split.test.y).dtype == torch.float32


def test_toy1d_is_a_noisy_cubic_generated_from_its_seed():
    split = load_dataset("toy1d")
    assert (len(split.train), len(split.test)) == (20, 200) and split.output_dim == 1
    x_tr, y_tr = split.x_norm.invert(split.train.x), split.y_norm.invert(split.train.y)
    x_te, y_te = split.x_norm.invert(split.test.x), split.y_norm.invert(split.test.y)
    assert x_tr.min() >= -4 and x_tr.max() <= 4
    torch.testing.assert_close(x_te.squeeze(1), torch.linspace(-5, 5, 200), atol=1e-4, rtol=0)
    noise = torch.cat([y_tr - x_tr**3, y_te - x_te**3])
    assert 2.0 < noise.std().item() < 4.0  # ε ~ N(0, 9)
    again = load_dataset("toy1d")
    assert torch.equal(again.train.x, split.train.x) and torch.equal(again.test.y, split.test.y)
    other = load_dataset("toy1d", seed=1, test_range=(-4.0, 4.0))
    assert not torch.equal(other.train.x, split.train.x)
    assert other.x_norm.invert(other.test.x).abs().max().item() == pytest.approx(4, abs=1e-4)
    with pytest.raises(ConfigError, match="num_train >= 2"):
        load_dataset("toy1d", num_train=1)


def test_array_dataset_indexes_by_int_and_by_index_tensor():
    ds = ArrayDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6) * 10)
    x, y = ds[2]
    assert x.tolist() == [4.0, 5.0] and y.item() == 20
    x, y = ds[torch.tensor([5, 0])]
    assert x.shape == (2, 2) and y.tolist() == [50, 0] and len(ds) == 6
    with pytest.raises(DataError, match=r"x \(6, 2\) and y \(5,\)"):
        ArrayDataset(torch.zeros(6, 2), torch.zeros(5))


def test_split_checks_its_fields():
    ds = ArrayDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="num_classes must be set for classification"):
        Split(name="s", train=ds, test=ds, task="classification", num_classes=None)
    with pytest.raises(ConfigError, match="task must be one of"):
        Split(name="s", train=ds, test=ds, task="ranking", num_classes=None)
    other = ArrayDataset(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(DataError, match=r"train inputs have shape \(4, 3\) but test .*\(4, 2\)"):
        Split(name="s", train=ds, test=other, task="classification", num_classes=2)


@pytest.mark.parametrize("spec, match", [
    ("imagenet", "unknown dataset 'imagenet'; accepted: digits, digits-image, diabetes, toy1d, "
                 "toy1d-hetero, blobs, sine, seasonal, hourly, mnist:PATH"),
    ("mnist", "dataset 'mnist' needs a path: mnist:PATH"),
    ("digits:/tmp", "dataset 'digits' is built in and takes no path"),
])
def test_load_dataset_rejects_bad_specs_listing_what_is_accepted(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_dataset(spec)


def test_load_dataset_rejects_options_the_loader_does_not_take():
    with pytest.raises(ConfigError, match=r"'digits' does not take option\(s\) \['flat'\]"):
        load_dataset("digits", flat=False)
    with pytest.raises(ConfigError, match=r"'toy1d' does not take option\(s\) \['bogus'\]; "
                                          r"it takes \['num_train'"):
        load_dataset("toy1d", bogus=1)


def test_accepted_names_are_documented_in_the_registry():
    from dptrain.data.datasets import registry

    for name in accepted_names():
        assert name.split(":")[0].replace("PATH", "") in registry.__doc__


def test_package_docstring_example_runs():
    """The usage example at the top of dptrain.data is real code."""
    lines = dptrain.data.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    import"))
    end = next(i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith(" "))
    namespace: dict = {}
    exec(textwrap.dedent("\n".join(lines[start:end])), namespace)
    assert namespace["state"] == {**namespace["state"], "epoch": 1, "position": 719}
    x, y = next(iter(namespace["loader"]))
    assert x.shape == (32, 64) and y.dtype == torch.int64
