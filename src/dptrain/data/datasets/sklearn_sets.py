"""Built-in sets from scikit-learn's bundled files (no download): digits and diabetes.

scikit-learn is imported only when one of these is loaded, because importing it takes about a
second and most runs read other data.
"""

from __future__ import annotations

import numpy as np
import torch

from dptrain.data.datasets.base import (
    ArrayDataset,
    Normalisation,
    Split,
    check_finite,
    regression_split,
)

DIGITS_TEST_SIZE = 360  # 1437 train / 360 test of 1797
DIABETES_TEST_FRACTION = 0.2  # 353 train / 89 test of 442


def load_digits(*, flat: bool = True) -> Split:
    """Handwritten digits, 8x8 pixels valued 0..16, 10 classes; 1437 train / 360 test.

    The split is stratified and fixed (`train_test_split(test_size=360, stratify=y,
    random_state=0)`). Inputs are `x / 16` minus the per-pixel mean of the training part, shaped
    (64,) when `flat`, else (1, 8, 8).
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(bunch.data, bunch.target,
                                              test_size=DIGITS_TEST_SIZE, stratify=bunch.target,
                                              random_state=0)
    shape = (-1, 64) if flat else (-1, 1, 8, 8)
    x_tr, x_te = torch.from_numpy(x_tr).reshape(shape), torch.from_numpy(x_te).reshape(shape)
    # The scaling is done as x/16 - mean(x_train/16) because that is what the TAGI tests use;
    # the recorded Normalisation is the same map in raw units.
    mean = (x_tr / 16).mean(dim=0)
    x_norm = Normalisation(mean=(16 * mean).float(), std=torch.tensor(16.0))
    return Split(name="digits" if flat else "digits-image", task="classification",
                 num_classes=10, x_norm=x_norm,
                 train=_digits_part(x_tr, y_tr, mean), test=_digits_part(x_te, y_te, mean))


def _digits_part(x: torch.Tensor, y: np.ndarray, mean: torch.Tensor) -> ArrayDataset:
    return ArrayDataset((x / 16 - mean).float(), torch.from_numpy(y).long())


def load_diabetes() -> Split:
    """Diabetes progression regression: 10 features, 1 target; 353 train / 89 test.

    The split is fixed (`train_test_split(test_size=0.2, random_state=0)`); features and target
    are standardised with training statistics (`split.y_norm.invert` gives original units).
    """
    from sklearn.datasets import load_diabetes as sk_load_diabetes
    from sklearn.model_selection import train_test_split

    bunch = sk_load_diabetes(scaled=False)
    check_finite(bunch.data, where="sklearn diabetes features")
    x_tr, x_te, y_tr, y_te = train_test_split(bunch.data, bunch.target,
                                              test_size=DIABETES_TEST_FRACTION, random_state=0)
    t = torch.from_numpy
    return regression_split("diabetes", t(x_tr), t(y_tr), t(x_te), t(y_te))
