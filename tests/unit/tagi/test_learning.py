"""End-to-end learning: digits classification with HRC against pytagi's reference error (an FNN
and a CNN), and the predictive uncertainty of a 1D toy regression (issue 3, Correctness).

The results page (docs/results.md) quotes these tests' numbers, so the tests assert them as
quoted: the errors per seed in test images out of 360 and the coverages in test points out of
200. They are exact for the float32 kernels of this project's machines at one thread (the
conftest's); another CPU's kernels can move a seed by an image, and then the results page and
these constants are re-measured together. pytagi's errors on the same protocol come from its own run,
bench/results/pytagi_digits_reference.json (bench/pytagi/pytagi_digits_reference.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from dptrain.data import load_digits as load_digit_images
from dptrain.tagi import (AvgPool2d, BatchNorm2d, Conv2d, HRCSoftmax, LayerBlock, Linear,
                          OutputUpdater, ReLU, ResNetBlock, Sequential, manual_seed)

REFERENCE = Path(__file__).resolve().parents[3] / "bench" / "results" / \
    "pytagi_digits_reference.json"


def _pytagi_mean_error(network: str) -> float:
    """pytagi 0.2.1's mean test error (%) on the same protocol, data and order."""
    record = json.loads(REFERENCE.read_text())["networks"][network]
    return record["summary"]["pytagi"]["mean_test_error_percent"]


#: Wrong test images (of 360) per seed: the FNN, seeds 0-2 (1.94 / 1.94 / 1.67 %).
FNN_WRONG = [7, 7, 6]
#: The CNN, seeds 0-5 (1.94 / 2.50 / 1.67 / 1.94 / 1.67 / 1.11 %, mean 1.81 %).
CNN_WRONG = [7, 9, 6, 7, 6, 4]
#: The small ResNet, seeds 0-2 (3.06 / 1.39 / 1.39 %).
RESNET_WRONG = [11, 5, 5]


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, stratify=y, random_state=0)
    mean = (x_tr / 16.0).mean(0)  # per-pixel training mean
    as_x = lambda a: torch.tensor(a / 16.0 - mean, dtype=torch.float32)  # noqa: E731
    return as_x(x_tr), torch.tensor(y_tr), as_x(x_te), torch.tensor(y_te)


def _fnn() -> Sequential:
    return Sequential(Linear(64, 128), ReLU(), Linear(128, 128), ReLU(), Linear(128, 11))


def _digits_error(seed: int, data, build=_fnn) -> float:
    x_tr, y_tr, x_te, y_te = data
    manual_seed(seed)
    net = build()
    hrc = HRCSoftmax(num_classes=10)
    updater = OutputUpdater(net.device)
    order = np.random.default_rng(seed)
    for _ in range(10):
        net.train()
        perm = torch.as_tensor(order.permutation(len(x_tr)))
        for start in range(0, len(x_tr), 32):
            batch = perm[start:start + 32]
            net(x_tr[batch])
            y_obs, y_idx = hrc.encode(y_tr[batch])
            updater.update_using_indices(net.output_z_buffer, y_obs, 0.05**2, y_idx,
                                         net.input_delta_z_buffer)
            net.backward()
            net.step()
    net.eval()
    mu, var = net(x_te)
    return 100.0 * (hrc.predict(mu, var) != y_te).double().mean().item()


def _wrong(errors: list[float]) -> list[int]:
    return [round(e * 360 / 100) for e in errors]


#: How far another CPU's float32 kernels may move one seed's count of wrong test images from
#: the recorded one (the figures are one machine's: one seed moves by 3-4 of the 360 images
#: when only the rounding of the kernels changes, as the CNN test below measured).
ROUNDING_WRONG = 4


def _assert_as_recorded(errors: list[float], recorded: list[int]) -> None:
    wrong = _wrong(errors)
    assert all(abs(w - r) <= ROUNDING_WRONG for w, r in zip(wrong, recorded, strict=True)), \
        f"wrong test images {wrong}, recorded {recorded} (test errors {errors} %)"


@pytest.mark.recorded
def test_digits_matches_or_beats_pytagi():
    """FNN 64-128-128-11, HRC, batch 32, σ_v = 0.05, 10 epochs, stratified 1437/360 split:
    the errors the results page quotes, and a mean no worse than pytagi's (2.22 %)."""
    data = _digits()
    assert len(data[0]) == 1437 and len(data[2]) == 360
    errors = [_digits_error(seed, data) for seed in range(3)]
    _assert_as_recorded(errors, FNN_WRONG)
    assert np.mean(errors) <= _pytagi_mean_error("fnn")


def _cnn() -> Sequential:
    """pytagi's MNIST classification CNN scaled to 8x8 images."""
    return Sequential(Conv2d(1, 16, 3, padding=1), ReLU(), AvgPool2d(2),
                      Conv2d(16, 32, 3, padding=1), ReLU(), AvgPool2d(2),
                      Linear(128, 64), ReLU(), Linear(64, 11))


@pytest.mark.slow
@pytest.mark.recorded
def test_cnn_digits_learns_like_pytagi():
    """The CNN, HRC head, batch 32, σ_v = 0.05, 10 epochs, on the built-in digit images
    (1, 8, 8) = pixels/16 minus the training mean: the errors of seeds 0-5 the results page quotes
    (about 6 s on one idle core), and a mean no worse than pytagi's (2.27 %).

    Six seeds, not three: one seed's error moves by ±1 % (3-4 of the 360 test images) when
    only the float32 rounding of the kernels changes (e.g. channels-last convolutions)."""
    split = load_digit_images(flat=False)
    data = (split.train.x, split.train.y, split.test.x, split.test.y)
    assert data[0].shape == (1437, 1, 8, 8)
    errors = [_digits_error(seed, data, _cnn) for seed in range(6)]
    _assert_as_recorded(errors, CNN_WRONG)
    assert np.mean(errors) <= _pytagi_mean_error("cnn")


#: Our bar for the small ResNet below on the same protocol.
RESNET_DIGITS_ERROR = 4.0


def _resnet_block(c_in: int, c_out: int) -> LayerBlock:
    """pytagi's ResNet layer order (its resnet18 example): conv without bias, activation,
    BatchNorm, twice."""
    return LayerBlock(Conv2d(c_in, c_out, 3, bias=False, padding=1), ReLU(), BatchNorm2d(c_out),
                      Conv2d(c_out, c_out, 3, bias=False, padding=1), ReLU(),
                      BatchNorm2d(c_out))


def _small_resnet() -> Sequential:
    """A stem, an identity block at 4x4 and a projection block (8 → 16 channels), 8x8 input."""
    return Sequential(
        Conv2d(1, 8, 3, bias=False, padding=1), ReLU(), BatchNorm2d(8), AvgPool2d(2),
        ResNetBlock(_resnet_block(8, 8)),
        ResNetBlock(_resnet_block(8, 16),
                    LayerBlock(Conv2d(8, 16, 1, bias=False), BatchNorm2d(16))),
        AvgPool2d(2), Linear(64, 64), ReLU(), Linear(64, 11))


@pytest.mark.slow
@pytest.mark.recorded
def test_small_resnet_with_batchnorm_learns_digits():
    """Two residual blocks with BatchNorm (running statistics used at test time), same protocol
    as the CNN: the measured errors of seeds 0-2, mean 1.94 %, under our bar of 4 % (about 7 s
    on one idle core)."""
    split = load_digit_images(flat=False)
    data = (split.train.x, split.train.y, split.test.x, split.test.y)
    errors = [_digits_error(seed, data, _small_resnet) for seed in range(3)]
    _assert_as_recorded(errors, RESNET_WRONG)
    assert np.mean(errors) <= RESNET_DIGITS_ERROR


#: Test points (of 200) inside the ±3σ band, seeds 0-2, as the results page quotes them.
TOY_INSIDE_3SIGMA = [199, 199, 200]


@pytest.mark.recorded
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_toy_regression_band_covers_the_data(seed):
    """y = x³ + ε, ε ~ N(0, 9), 20 training points on [-4, 4]: the predictive distribution
    (network variance plus observation noise) is calibrated on 200 fresh test points. For a
    Gaussian prediction the ±1σ, ±2σ, ±3σ bands hold 68.3 %, 95.4 %, 99.7 % of the data; each
    measured coverage must lie within three binomial standard deviations of that (measured:
    71-75 %, 96-98 %, 99.5-100 %), and the band must be informative: mean predictive σ at most
    2.5 times the noise σ (measured 1.6-2.1 times; the epistemic part is large with 20 points).

    Mutations tried, each failing this test: Δv = v·g instead of v²·g (bands far too narrow,
    ±3σ coverage 76-86 %), Δv dropped so variances keep their prior (±1σ coverage 100 %, σ
    about 8-9 times the noise), the forward variance without m_A² v_W (±3σ coverage 88-96 %),
    and without v_A m_W² (seed 0: ±1σ coverage 54 %). The old bounds (≥ 95 % at ±3σ, σ < 3x
    the noise) let the last one through."""
    g = torch.Generator().manual_seed(seed)
    noisy_cube = lambda x: x**3 + 3.0 * torch.randn(x.shape, generator=g)  # noqa: E731
    x = torch.rand(20, 1, generator=g) * 8 - 4
    y = noisy_cube(x)
    x_test = torch.linspace(-4, 4, 200)[:, None]
    y_test = noisy_cube(x_test)
    x_mean, x_std, y_mean, y_std = x.mean(), x.std(), y.mean(), y.std()
    sigma_v = 3.0 / y_std.item()  # the noise σ in normalised units
    manual_seed(seed)
    net = Sequential(Linear(1, 50), ReLU(), Linear(50, 1))
    updater = OutputUpdater(net.device)
    for _ in range(50):
        perm = torch.randperm(20, generator=g)
        for start in range(0, 20, 5):
            batch = perm[start:start + 5]
            net((x[batch] - x_mean) / x_std)
            updater.update(net.output_z_buffer, (y[batch] - y_mean) / y_std, sigma_v**2,
                           net.input_delta_z_buffer)
            net.backward()
            net.step()
    net.eval()
    mu, var = net((x_test - x_mean) / x_std)
    mean = mu * y_std + y_mean
    std = (var + sigma_v**2).sqrt() * y_std
    inside = [int(((y_test - mean).abs() <= k * std).sum()) for k in (1, 2, 3)]
    for k, gaussian in ((1, 0.6827), (2, 0.9545), (3, 0.9973)):
        coverage = inside[k - 1] / len(y_test)
        tolerance = 3 * math.sqrt(gaussian * (1 - gaussian) / len(y_test))
        assert abs(coverage - gaussian) <= tolerance, f"±{k}σ band holds {coverage:.1%}"
    # A recorded count compared exactly, on any CPU: no test point lies near the ±3σ edge
    # (nearest 0.018σ, seed 1), far beyond what float32 rounding of this run moves (~1e-6σ).
    assert float(((y_test - mean).abs() / std - 3).abs().min()) > 1e-3
    assert inside[2] == TOY_INSIDE_3SIGMA[seed], inside  # the results page's 99.5 / 99.5 / 100 %
    assert std.mean().item() <= 2.5 * 3.0, f"mean predictive σ {std.mean().item():.2f}"
