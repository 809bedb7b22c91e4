"""The 1D toy regression of the TAGI papers: y = x³ + ε, ε ~ N(0, 3²)."""

from __future__ import annotations

import torch

from dptrain.data.datasets.base import Split, regression_split
from dptrain.errors import ConfigError

TRAIN_RANGE = (-4.0, 4.0)


def load_toy1d(*, num_train: int = 20, num_test: int = 200,
               test_range: tuple[float, float] = (-5.0, 5.0), noise_std: float = 3.0,
               seed: int = 0) -> Split:
    """`num_train` points drawn uniformly on [-4, 4] and `num_test` evenly spaced on
    `test_range`, each with noise ε ~ N(0, noise_std²) (variance 9 by default), from a
    `torch.Generator` seeded with `seed`.

    The default test range [-5, 5] reaches past the training data, as in the papers' figures,
    so the test metric also measures extrapolation (pass (-4, 4) to measure interpolation only).
    x and y are standardised with training statistics; `split.y_norm.invert` undoes it.
    """
    if num_train < 2 or num_test < 1:
        raise ConfigError(f"toy1d needs num_train >= 2 (to standardise) and num_test >= 1, got "
                          f"num_train={num_train}, num_test={num_test}")
    if not test_range[0] < test_range[1]:
        raise ConfigError(f"toy1d test_range must be (low, high) with low < high, "
                          f"got {test_range}")
    g = torch.Generator().manual_seed(seed)
    low, high = TRAIN_RANGE
    x_train = low + (high - low) * torch.rand(num_train, 1, generator=g, dtype=torch.float64)
    x_test = torch.linspace(*test_range, num_test, dtype=torch.float64).reshape(-1, 1)
    y_train = x_train**3 + noise_std * torch.randn(num_train, 1, generator=g, dtype=torch.float64)
    y_test = x_test**3 + noise_std * torch.randn(num_test, 1, generator=g, dtype=torch.float64)
    return regression_split("toy1d", x_train, y_train, x_test, y_test)


#: toy1d-hetero: noise standard deviation a + b·|x| on x in [-1, 1] (a is 1/6 of the largest).
HETERO_NOISE = (0.1, 0.5)
HETERO_RANGE = (-1.0, 1.0)


def hetero_noise_std(x: torch.Tensor) -> torch.Tensor:
    """The true noise standard deviation of toy1d-hetero at raw inputs `x`."""
    a, b = HETERO_NOISE
    return a + b * x.abs()


def load_toy1d_hetero(*, num_train: int = 500, num_test: int = 200, seed: int = 0) -> Split:
    """Heteroscedastic 1D regression: y = sin(3x) + ε, ε ~ N(0, (0.1 + 0.5|x|)²).

    `num_train` points uniform on [-1, 1], `num_test` evenly spaced on the same interval (noise
    far outside the data is not learnable, so the test measures interpolation). The noise at
    the edges is six times the noise at the centre: a fixed σ_v must be wrong somewhere.
    """
    if num_train < 2 or num_test < 1:
        raise ConfigError(f"toy1d-hetero needs num_train >= 2 (to standardise) and num_test >= 1, "
                          f"got num_train={num_train}, num_test={num_test}")
    g = torch.Generator().manual_seed(seed)
    low, high = HETERO_RANGE
    x_train = low + (high - low) * torch.rand(num_train, 1, generator=g, dtype=torch.float64)
    x_test = torch.linspace(low, high, num_test, dtype=torch.float64).reshape(-1, 1)

    def draw(x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
        return torch.sin(3 * x) + hetero_noise_std(x) * noise

    return regression_split("toy1d-hetero", x_train, draw(x_train), x_test, draw(x_test))
