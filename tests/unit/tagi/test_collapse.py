"""No silent failure to learn (docs/design.md, contract 10): the registry's TAGI CNN does not
collapse on MNIST-format digits, a run that does (a network whose hidden ReLUs are dead for
every input from the start, tests/_collapsing_model.py: collapsed by construction, whatever the
CPU's float summation order) is named in one warning line and in the summary, healthy runs and
regression runs never warn, and the check's sums reduce like every other metric."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from dptrain.data import load_dataset
from dptrain.runtime import init_distributed
from dptrain.errors import TrainingCollapsed
from dptrain.learners import collapse
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.models import build_model
from dptrain.train.trainer import TrainConfig, Trainer

BENCH = Path(__file__).resolve().parents[3] / "bench"
COLLAPSED_MODEL = f"{Path(__file__).resolve().parents[2] / '_collapsing_model.py'}:dead_relus"
"""A model file whose hidden ReLU layer is dead for every input from its first step."""


def _digit_files():
    spec = importlib.util.spec_from_file_location("digit_files",
                                                  BENCH / "common" / "digit_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mnist_digits(tmp_path_factory):
    """scikit-learn's digits as MNIST IDX files: 28x28, 1500 train / 297 test."""
    directory = _digit_files().write_mnist_digits(tmp_path_factory.mktemp("mnist"))
    return load_dataset(f"mnist:{directory}")


def _fit(split, out: Path, model: str, seed: int, epochs: int = 1, **learner) -> dict:
    torch.set_num_threads(1)
    built = create_learner(ModelConfig(model=model), LearnerConfig(**learner), split, seed=seed)
    config = TrainConfig(out_dir=out, epochs=epochs, seed=seed, progress=False,
                         async_checkpoints=False)
    return Trainer(built, split, config, init_distributed()).fit()


def _collapse_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "collapsed" in r.getMessage()]


def test_default_cnn_never_collapses_on_mnist_digits(mnist_digits, tmp_path, caplog):
    """8 seeds x 1 epoch of the default tagi-cnn: every run learns (below 80 % test error
    after its first epoch, 20-65 % measured, where chance is 90 %) and none warns."""
    caplog.set_level(logging.WARNING)
    errors = []
    for seed in range(8):
        summary = _fit(mnist_digits, tmp_path / str(seed), "tagi-cnn", seed)
        assert summary["collapse"] is None, (seed, summary["collapse"])
        errors.append(summary["test_error"])
    assert max(errors) < 0.8, errors
    assert not _collapse_warnings(caplog)


def test_a_collapsed_run_is_named_once_and_recorded(mnist_digits, tmp_path, caplog):
    """A network collapsed by construction (its hidden ReLUs dead for every input, so they
    never receive an innovation): at chance from the first epoch, every test prediction in one
    class; one warning line naming symptom and remedies, the record in the summary."""
    caplog.set_level(logging.WARNING)
    summary = _fit(mnist_digits, tmp_path / "run", COLLAPSED_MODEL, seed=0, epochs=2)
    assert summary["test_error"] > 0.8
    record = summary["collapse"]
    assert record["epoch"] == 1 and record["output_spread"] < collapse.SPREAD_TOL
    assert record["top_class_share"] == 1.0
    (line,) = _collapse_warnings(caplog)
    assert "\n" not in line and "epoch 1" in line and collapse.REMEDIES in line


def test_stop_on_collapse_raises_after_the_evaluation(mnist_digits, tmp_path):
    """The same network: the first evaluation finds the collapse and stops the run there."""
    with pytest.raises(TrainingCollapsed, match="collapsed at epoch 1") as err:
        _fit(mnist_digits, tmp_path / "run", COLLAPSED_MODEL, seed=0, epochs=3,
             stop_on_collapse=True)
    assert err.value.exit_code == 7


def test_healthy_seeds_of_the_pytagi_network_do_not_warn(mnist_digits, tmp_path, caplog):
    """The same network on seeds that learn, including one still near chance after its first
    epoch (its predictions already depend on the input)."""
    caplog.set_level(logging.WARNING)
    for seed in (1, 2):
        assert _fit(mnist_digits, tmp_path / str(seed), "tagi-cnn-pytagi", seed)["collapse"] \
            is None
    assert not _collapse_warnings(caplog)


@pytest.mark.parametrize("dataset, model, heteroscedastic", [
    ("toy1d", "tagi-mlp", False), ("diabetes", "tagi-mlp", False),
    ("toy1d-hetero", "tagi-mlp", True)])
def test_regression_runs_do_not_warn(dataset, model, heteroscedastic, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    split = load_dataset(dataset)
    built = create_learner(ModelConfig(model=model, heteroscedastic=heteroscedastic),
                           LearnerConfig(), split, seed=0)
    config = TrainConfig(out_dir=tmp_path, epochs=2, progress=False, monitor="test_mse",
                         async_checkpoints=False)
    summary = Trainer(built, split, config, init_distributed()).fit()
    assert summary["collapse"] is None
    assert not _collapse_warnings(caplog)


def test_output_spread_sums_reduce_exactly_over_batches():
    """Sums of two halves give the whole batch's spread; a constant output spreads 0; batches of
    one sample alone tell nothing."""
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(10, 3, generator=g)
    whole = collapse.output_sums(mu)
    halves = [collapse.output_sums(mu[:4]), collapse.output_sums(mu[4:])]
    summed = {k: (halves[0][k][0] + halves[1][k][0], halves[0][k][1] + halves[1][k][1])
              for k in whole}
    means = {k: s / c for k, (s, c) in summed.items()}
    spread = collapse.pop_output_spread(means)
    assert not means  # every entry taken out again
    assert spread == pytest.approx(mu.double().std(0, unbiased=False).max().item(), rel=1e-9)
    flat = {k: s / c for k, (s, c) in collapse.output_sums(torch.full((6, 11), 0.3)).items()}
    assert collapse.pop_output_spread(flat) < 1e-7
    single = {k: s / c for k, (s, c) in collapse.output_sums(torch.ones(1, 2)).items()}
    assert collapse.pop_output_spread(single) is None
    assert collapse.verdict(None, 1) is None and collapse.verdict(0.5, 1) is None


def test_pytagi_network_keeps_pytagis_initialisation():
    """tagi-cnn-pytagi is pytagi's CNN at gain 1; the default differs only by the gain on
    MNIST-sized images (variances x0.25), and not at all on 8x8 digits."""
    def variances(name, shape):
        torch.manual_seed(0)
        from dptrain.tagi import manual_seed
        manual_seed(0)
        return build_model(name, shape, 11).flat_params[1].clone()

    big = (1, 28, 28)
    exact, default = variances("tagi-cnn-pytagi", big), variances("tagi-cnn", big)
    torch.testing.assert_close(default, exact * 0.25)
    small = (1, 8, 8)
    torch.testing.assert_close(variances("tagi-cnn", small), variances("tagi-cnn-pytagi", small))
