"""--monitor is checked against the metrics the run will report, found by asking the learner it
builds (dptrain.train.job.reported_metrics), before any worker starts."""

from __future__ import annotations

import csv

import pytest

from dptrain.cli.main import main
from dptrain.errors import ConfigError
from dptrain.train.job import check_monitor, load_job_split, reported_metrics
from dptrain.train.options import TrainOptions


def _names(train: list[str], evaluated: list[str]) -> list[str]:
    """The columns: train ones, and each evaluated one for the validation and the test part."""
    return sorted([f"train_{m}" for m in train] +
                  [f"{part}_{m}" for part in ("val", "test") for m in evaluated])


_GAUSSIAN = ["coverage_1sigma", "coverage_2sigma", "coverage_3sigma", "log_likelihood", "mse",
             "rmse"]


@pytest.mark.parametrize("model, dataset, expected", [
    ("tagi-mlp", "digits", _names(["error", "log_likelihood"],
                                  ["ece", "error", "log_likelihood"])),
    ("tagi-mlp", "toy1d", _names(_GAUSSIAN, _GAUSSIAN)),
    ("torch-mlp", "digits", _names(["error", "loss"], ["ece", "error", "loss"])),
    ("torch-mlp", "diabetes", _names(["loss", "mse", "rmse"], ["loss", "mse", "rmse"])),
])
def test_the_names_are_those_the_learner_reports_for_its_task(model, dataset, expected):
    options = TrainOptions(model=model, dataset=dataset, hidden=8)
    assert reported_metrics(options, load_job_split(options)) == expected


def test_the_names_are_the_columns_a_real_run_writes(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--model", "torch-mlp", "--hidden", "8", "--epochs",
                 "1", "--batch-size", "256", "--no-progress", "--out", str(out)]) == 0
    with open(out / "epochs.csv") as f:
        columns = next(csv.reader(f))
    options = TrainOptions(model="torch-mlp", hidden=8)
    # lr: the learning rate of the epoch's last step, which torch learners log beside
    assert sorted(columns) == sorted(["epoch", "step", "lr",
                                      *reported_metrics(options, load_job_split(options))])


def test_an_unknown_monitor_is_one_line_listing_the_names():
    options = TrainOptions(model="tagi-mlp", dataset="toy1d", hidden=8, monitor="val_error")
    with pytest.raises(ConfigError) as caught:
        check_monitor(options, load_job_split(options))
    message = str(caught.value)
    assert message.startswith("--monitor 'val_error' is not a metric of this run (tagi-mlp on "
                              "toy1d); it reports: test_coverage_1sigma, "), message
    assert "\n" not in message and "train_rmse" in message
    accepted = TrainOptions(model="tagi-mlp", dataset="toy1d", hidden=8,
                            monitor="train_coverage_2sigma")
    check_monitor(accepted, load_job_split(accepted))


def test_a_test_metric_never_chooses():
    """Contract 11: the test part is reported, never monitored; its validation twin is named."""
    options = TrainOptions(model="tagi-mlp", dataset="toy1d", hidden=8, monitor="test_rmse")
    with pytest.raises(ConfigError, match=r"^--monitor test_rmse: the test part is evaluated "
                                          r"and reported, never used to choose .* val_rmse$"):
        check_monitor(options, load_job_split(options))


@pytest.mark.parametrize("model", ["tagi-lstm", "torch-mlp"])
def test_several_series_report_the_per_series_measure_beside_the_rmse(model):
    """Issue 39: windows of several series report val_series_nrmse, which chooses by default
    (dptrain.learners.series_metrics), and val_rmse beside it."""
    options = TrainOptions(model=model, dataset="seasonal", hidden=8)
    names = reported_metrics(options, load_job_split(options))
    assert {"val_series_nrmse", "val_rmse", "test_rmse"} <= set(names)
    assert "test_series_nrmse" not in names  # it chooses; the test part reports as before
    assert not any(name.startswith(("val__", "test__")) for name in names)
