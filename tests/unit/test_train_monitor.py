"""--monitor is checked against the metrics the run will report, found by asking the learner it
builds (dptrain.train.job.reported_metrics), before any worker starts."""

from __future__ import annotations

import csv

import pytest

from dptrain.cli.main import main
from dptrain.errors import ConfigError
from dptrain.train.job import check_monitor, load_job_split, reported_metrics
from dptrain.train.options import TrainOptions


@pytest.mark.parametrize("model, dataset, expected", [
    ("tagi-mlp", "digits", ["test_ece", "test_error", "test_log_likelihood", "train_error",
                            "train_log_likelihood"]),
    ("tagi-mlp", "toy1d", [f"{s}_{m}" for s in ("test", "train") for m in (
        "coverage_1sigma", "coverage_2sigma", "coverage_3sigma", "log_likelihood", "mse",
        "rmse")]),
    ("torch-mlp", "digits", ["test_ece", "test_error", "test_loss", "train_error",
                             "train_loss"]),
    ("torch-mlp", "diabetes", ["test_loss", "test_mse", "test_rmse", "train_loss", "train_mse",
                               "train_rmse"]),
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
    options = TrainOptions(model="tagi-mlp", dataset="toy1d", hidden=8, monitor="test_error")
    with pytest.raises(ConfigError) as caught:
        check_monitor(options, load_job_split(options))
    message = str(caught.value)
    assert message.startswith("--monitor 'test_error' is not a metric of this run (tagi-mlp on "
                              "toy1d); it reports: test_coverage_1sigma, "), message
    assert "\n" not in message and "train_rmse" in message
    accepted = TrainOptions(model="tagi-mlp", dataset="toy1d", hidden=8,
                            monitor="train_coverage_2sigma")
    check_monitor(accepted, load_job_split(accepted))
