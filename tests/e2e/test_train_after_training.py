"""Nothing after the last training step loses the run (docs/design.md, contract 14): a
multi-series hourly file with the shape of trouble of real load data (a meter dead over its
training part that wakes up, one that wakes up in the last hours of it, a level shift in the
validation part; lookback 24, 24 h of validation, the last 168 h as test) trains, forecasts
and writes summary.json with finite moments; a failure injected after the last step
(`DPTRAIN_FAIL_AFTER_TRAINING`) leaves checkpoints, best/ and a summary.json naming it, one
line on stderr, no traceback and a non-zero status (issue 39)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dptrain.data.datasets.synthetic_series import LOAD_TEST, LOAD_VAL, write_load_csv
from dptrain.errors import AfterTrainingFailed
from tests._cli import base_env, dptrain_cmd, run

pytestmark = pytest.mark.e2e

TEST, VAL = LOAD_TEST, LOAD_VAL


def troubled_load_csv(path: Path, num_series: int = 6, seed: int = 0) -> Path:
    return write_load_csv(path, num_series=num_series, troubled=True, seed=seed)


def _args(data: Path, out: Path) -> list[str]:
    return ["train", "--model", "tagi-lstm", "--dataset", f"series:{data}", "--lookback", "24",
            "--horizon", "1", "--series-embedding", "4", "--test-size", str(TEST),
            "--val-size", str(VAL), "--time-features", "auto", "--forecast-every", "24",
            "--batch-size", "64", "--epochs", "1", "--no-progress", "--out", str(out)]


def test_a_failure_after_the_last_step_leaves_the_run_whole(tmp_path):
    data = troubled_load_csv(tmp_path / "load.csv")
    out = tmp_path / "run"
    env = {**base_env(), "DPTRAIN_FAIL_AFTER_TRAINING": "report"}
    done = run(dptrain_cmd(*_args(data, out)), env=env, timeout_s=240)
    assert done.returncode == AfterTrainingFailed.exit_code, done.output
    assert "Traceback" not in done.output
    lines = [line for line in done.stderr.splitlines() if "after it report" in line]
    assert len(lines) == 1, done.stderr
    assert "DPTRAIN_FAIL_AFTER_TRAINING=report" in lines[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_after_training"].startswith("report: InjectedFailure")
    assert math.isfinite(summary["test_rmse"])  # what was measured before it is kept
    assert any(p.name.startswith("step-") for p in (out / "checkpoints").iterdir())
    best = out / "checkpoints" / "best"
    assert best.is_dir() and any(best.iterdir())


def test_a_troubled_multi_series_file_forecasts_with_finite_moments(tmp_path):
    data = troubled_load_csv(tmp_path / "load.csv")
    out = tmp_path / "run"
    done = run(dptrain_cmd(*_args(data, out)), timeout_s=240)
    assert done.returncode == 0, done.output
    summary = json.loads((out / "summary.json").read_text())
    assert "failed_after_training" not in summary
    assert "forecast_failed_series" not in summary  # every series' forecast was computed
    for key in ("forecast_rmse", "forecast_log_likelihood", "forecast_nd",
                "forecast_variance_scale", "forecast_coverage_2sigma"):
        assert math.isfinite(summary[key]), (key, summary[key])
    # A meter constant over its training part is scaled like the typical one: scaled by its
    # own std (0.04 for meter 1), its waking values were thousands of stds, the windows'
    # RMSE in standard units 417 (and the pooled validation RMSE chose the epoch by them).
    assert summary["test_rmse"] < 20, summary["test_rmse"]
    assert summary["monitor"] == "val_series_nrmse"
    # the meter that woke up and the tripled one leave their training range in validation:
    # --window-scaling auto scales each window by its own level and spread, and says so once
    notice = [line for line in done.stderr.splitlines() if "leave their training range" in line]
    assert len(notice) == 1 and "meter0" in notice[0] and "meter2" in notice[0], done.stderr
    header = (out / "epochs.csv").read_text().splitlines()[0].split(",")
    assert {"val_series_nrmse", "val_rmse"} <= set(header)
