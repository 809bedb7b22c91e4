"""`dptrain train` reports how trustworthy its predictions are: heteroscedastic regression
(learned noise, interval coverage, bands) and calibration of classifiers."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from dptrain.cli.main import main
from dptrain.inference import load_run
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


def _direct_calibration(probs: torch.Tensor, labels: torch.Tensor) -> list[dict[str, float]]:
    """Per bin [k/10, (k+1)/10) of the top class probability (the last bin closed): share of
    samples, mean confidence and accuracy, and the ECE term share · |accuracy − confidence|."""
    conf, predicted = probs.double().max(1)
    correct = (predicted == labels).double()
    bins = []
    for k in range(10):
        inside = (conf >= k / 10) & ((conf < (k + 1) / 10) if k < 9 else (conf <= 1))
        share = inside.double().mean().item()
        conf_k = conf[inside].mean().item() if inside.any() else float("nan")
        acc_k = correct[inside].mean().item() if inside.any() else float("nan")
        bins.append({"share": share, "confidence": conf_k, "accuracy": acc_k,
                     "gap": share * abs(acc_k - conf_k) if inside.any() else 0.0})
    return bins


# ECE after this one-epoch run, measured 0.047 for tagi-mlp (test error 6 %). Adam's torch-mlp
# is still far from trained after one epoch (test error 38 %, ECE 0.33), so
# its value says nothing about dptrain and only its agreement with the model is checked.
TAGI_ECE_BOUND = 0.1


@pytest.mark.parametrize("model", ["tagi-mlp", "torch-mlp"])
def test_classification_reports_calibration(model, tmp_path):
    """The calibration a run reports is that of its model: the trained model, loaded in this
    process (`load_run`), predicts the test split, and the reliability bins and ECE computed
    directly from those probabilities equal the run's `calibration_bins` and `test_ece` (to
    1e-5), its accuracy the run's test error; the ECE itself is below a bound set from the
    measured value for TAGI. The old check accepted any ECE < 0.5. Mutations tried, each
    failing this test: binning by `conf · (NUM_BINS − 1)` in `calibration_sums` (both models),
    and the TAGI learner's evaluation probabilities without the output variance
    (`hrc.probabilities(mu, 0 · var)` in `TagiLearner.eval_step`)."""
    out = tmp_path / model
    assert main(["train", "--model", model, "--nproc", "1", "--epochs", "1", "--hidden", "32",
                 "--no-progress", "--out", str(out)]) == 0
    summary = _summary(out)
    run = load_run(out, which="last")
    pred = run.predict_split(run.load_data())
    want = _direct_calibration(pred.mean, pred.targets)
    got = summary["calibration_bins"]
    assert len(got) == 10
    for k, (mine, direct) in enumerate(zip(got, want)):
        for key in ("share", "confidence", "accuracy", "gap"):
            assert mine[key] == pytest.approx(direct[key], abs=1e-5, nan_ok=True), (k, key)
    assert summary["test_ece"] == pytest.approx(sum(b["gap"] for b in want), abs=1e-5)
    error = (pred.labels != pred.targets).double().mean().item()
    assert summary["test_error"] == pytest.approx(error, abs=1e-9)
    if model == "tagi-mlp":
        assert summary["test_ece"] < TAGI_ECE_BOUND
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
