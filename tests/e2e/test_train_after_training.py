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

import numpy as np
import pytest

from dptrain.errors import AfterTrainingFailed
from tests._cli import base_env, dptrain_cmd, run

pytestmark = pytest.mark.e2e

STEPS, TEST, VAL = 336, 168, 24


def troubled_load_csv(path: Path, num_series: int = 6, seed: int = 0) -> Path:
    """Hourly load of `num_series` meters (wide CSV) with a daily cycle: meter 0 dead over its
    training part, meter 1 zero until its training part's last hour, meter 2's level tripled
    from the validation part on."""
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    values = []
    for _ in range(num_series):
        level = rng.uniform(20, 300)
        cycle = np.sin(2 * np.pi * (t % 24) / 24 - rng.uniform(0, 2 * np.pi))
        values.append(level * (1 + 0.3 * cycle) + rng.normal(0, 0.05 * level, STEPS))
    values = np.array(values)
    train_end = STEPS - TEST - VAL
    values[0, :train_end] = 0.0
    values[1, :train_end - 1] = 0.0
    values[1, train_end - 1] = 0.5
    values[2, train_end:] *= 3.0
    hours = np.datetime64("2014-01-01T00") + t.astype("timedelta64[h]")
    rows = ["time," + ",".join(f"meter{s}" for s in range(num_series))]
    rows += [f"{hour}," + ",".join(f"{v:.3f}" for v in values[:, i])
             for i, hour in enumerate(hours)]
    path.write_text("\n".join(rows) + "\n")
    return path


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
    for key in ("forecast_rmse", "forecast_log_likelihood", "forecast_nd",
                "forecast_variance_scale", "forecast_coverage_2sigma"):
        assert math.isfinite(summary[key]), (key, summary[key])
