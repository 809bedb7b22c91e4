"""`dptrain train` reports how trustworthy its predictions are: heteroscedastic regression
(learned noise, interval coverage, bands) and calibration of classifiers."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dptrain.cli.main import main
from tests._cli import dptrain_cmd, run

pytestmark = pytest.mark.e2e

HETEROS = ["train", "--dataset", "toy1d-hetero", "--heteroscedastic", "--epochs", "2",
           "--batch-size", "10", "--checkpoint-every", "20", "--no-progress"]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _columns(out: Path) -> list[str]:
    with open(out / "epochs.csv") as f:
        return next(csv.reader(f))


def test_heteroscedastic_regression_on_two_processes_resumes_bit_exactly(tmp_path):
    clean = run(dptrain_cmd(*HETEROS, "--out", str(tmp_path / "clean")), timeout_s=180)
    assert clean.returncode == 0, clean.output
    assert "interval coverage 1σ" in clean.stdout
    summary = _summary(tmp_path / "clean")
    for key in ("test_rmse", "test_log_likelihood", "test_coverage_1sigma",
                "test_coverage_2sigma", "test_coverage_3sigma"):
        assert key in summary, key
    assert summary["test_coverage_1sigma"] < summary["test_coverage_2sigma"] <= \
        summary["test_coverage_3sigma"] <= 1.0
    assert (tmp_path / "clean" / "predictions.png").stat().st_size > 1000
    killed = run(dptrain_cmd(*HETEROS, "--out", str(tmp_path / "killed"), "--fail-at", "1:45",
                             "--max-restarts", "1"), timeout_s=240)
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.stdout
    assert _summary(tmp_path / "killed")["params_sha256"] == summary["params_sha256"]


@pytest.mark.parametrize("model", ["tagi-mlp", "torch-mlp"])
def test_classification_reports_calibration(model, tmp_path):
    out = tmp_path / model
    assert main(["train", "--model", model, "--nproc", "1", "--epochs", "1", "--hidden", "32",
                 "--no-progress", "--out", str(out)]) == 0
    summary = _summary(out)
    assert 0.0 <= summary["test_ece"] < 0.5
    assert len(summary["calibration_bins"]) == 10
    assert "test_ece" in _columns(out)
    assert not [c for c in _columns(out) if c.startswith("test_calib")]
    assert (out / "reliability.png").stat().st_size > 1000


def test_heteroscedastic_is_refused_where_the_output_has_no_noise_pair(tmp_path, capsys):
    status = main(["train", "--heteroscedastic", "--nproc", "1", "--out", str(tmp_path / "a")])
    assert status != 0
    assert "--heteroscedastic is for regression" in capsys.readouterr().err
    status = main(["train", "--heteroscedastic", "--model", "torch-mlp", "--nproc", "1",
                   "--dataset", "toy1d", "--out", str(tmp_path / "b")])
    assert status != 0
    assert "heteroscedastic is for TAGI models" in capsys.readouterr().err
    status = main(["train", "--heteroscedastic", "--model", "tagi-cnn", "--nproc", "1",
                   "--dataset", "toy1d", "--out", str(tmp_path / "c")])
    assert status == 2
    assert "tagi-cnn does not" in capsys.readouterr().err
