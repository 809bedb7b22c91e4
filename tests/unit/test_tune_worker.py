"""The search's own logic with a fake trial runner and a fake clock: --max-trials, the budget
and its stop line, leases and takeover, Ctrl-C and resume, failures (no processes here; the
real runs are in tests/e2e/test_tune.py)."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("optuna")

from dptrain.errors import ConfigError  # noqa: E402
from dptrain.tune import FakeClock, TuneOptions, tune  # noqa: E402
from tests._tune import FakeRunner  # noqa: E402

BASE = {"model": "tagi-mlp", "dataset": "digits", "epochs": 3, "nproc": 2}


def run(tmp_path, clock, runner, lines=None, **kw):
    kw.setdefault("space", ("lr=log:1e-3:1e-1",))
    options = TuneOptions(out=str(tmp_path / "study"), monitor="train_error", pruner="none",
                          sampler_seed=0, **kw)
    said = lines if lines is not None else []
    return tune(options, dict(BASE), runner=runner, clock=clock, preflight=False, poll_s=5.0,
                say=said.append)


def table(tmp_path):
    with open(tmp_path / "study" / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_max_trials_and_objective(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock)
    summary = run(tmp_path, clock, runner, max_trials=4)
    rows = table(tmp_path)
    assert [r["state"] for r in rows] == ["COMPLETE"] * 4
    assert len(runner.started) == 4 and len(set(runner.started)) == 4
    for r in rows:  # each trial's value is the best train_error its run recorded
        recorded = json.loads((tmp_path / "study" / f"trial-{int(r['number']):04d}" /
                               "summary.json").read_text())
        assert float(r["value"]) == pytest.approx(recorded["best_train_error"])
        assert float(r["lr"]) + 1 / 3 == pytest.approx(float(r["value"]))
    assert summary["best"]["value"] == min(float(r["value"]) for r in rows)
    assert summary["stop"] == "max-trials: 4 of 4 trials run or running"
    best = (tmp_path / "study" / "best.toml").read_text()
    assert f"lr = {summary['best']['params']['lr']!r}" in best
    # 2 processes x 3 epochs x 60 s per trial
    assert float(rows[0]["process_hours"]) == pytest.approx(2 * 180 / 3600, rel=0.05)


def test_rerun_continues_without_repeats(tmp_path):
    clock = FakeClock()
    run(tmp_path, clock, FakeRunner(clock), max_trials=2)
    runner = FakeRunner(clock)
    run(tmp_path, clock, runner, max_trials=3)
    assert len(runner.started) == 1
    assert [r["number"] for r in table(tmp_path)] == ["0", "1", "2"]


def test_budget_never_launches_past_the_limit(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock)
    lines: list[str] = []
    # a trial costs 2 x 180 s = 0.1 process-hours: 0.35 fits three, not a fourth
    summary = run(tmp_path, clock, runner, lines, max_trials=0, budget_process_hours=0.35)
    assert len(runner.started) == 3
    assert summary["process_hours"] <= 0.35
    stop = "budget: 0.3 of 0.35 process-hours spent; next trial ≈ 0.1: not launched"
    assert summary["stop"] == stop and stop in lines
    assert json.loads((tmp_path / "study" / "study.json").read_text())["stop"] == stop
    assert any("spent 0.2 of 0.35 process-hours" in line for line in lines)  # progress line


def test_wall_budget(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock)
    summary = run(tmp_path, clock, runner, max_trials=0, budget_hours=0.16)  # 3 min a trial
    assert len(runner.started) == 3
    assert summary["stop"].startswith("budget: 0.15 of 0.16 hours spent; next trial ≈ 0.05")


def test_expected_failures_go_on_and_a_bad_first_trial_stops(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock, exit_codes=[3, 6, 0])
    run(tmp_path, clock, runner, max_trials=3)
    assert [r["state"] for r in table(tmp_path)] == ["FAIL", "FAIL", "COMPLETE"]
    assert [r["note"] for r in table(tmp_path)][:2] == ["bad data (exit 3)", "NaN loss (exit 6)"]
    clock = FakeClock()
    with pytest.raises(ConfigError, match="trial 0 refused its options"):
        run(tmp_path / "other", clock, FakeRunner(clock, exit_codes=[2]), max_trials=3)


def test_expired_lease_is_taken_over_in_the_same_run_dir(tmp_path):
    """A worker killed mid-trial (its lease never renewed) loses no trial: the next worker takes
    it over in the same run directory, and it counts once toward --max-trials."""
    clock = FakeClock()
    runner = FakeRunner(clock)

    class Killed(BaseException):
        pass

    def die(line):  # the worker "dies" as its first trial starts, without releasing its lease
        if "starts" in line:
            raise Killed

    with pytest.raises(Killed):
        run(tmp_path, clock, runner, lines=_Say(die), max_trials=2, lease_s=120)
    # as if SIGKILLed: the lease stays as it was; put it back after the Ctrl-C release
    import optuna

    from dptrain.tune.worker import LEASE
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(tmp_path / "study" / "study.journal")))
    sid = storage.get_study_id_from_name("study")
    storage.set_trial_system_attr(storage.get_trial_id_from_study_id_trial_number(sid, 0),
                                  LEASE, clock.now() + 120)
    lines: list[str] = []
    second = FakeRunner(clock)
    run(tmp_path, clock, second, lines, max_trials=2, lease_s=120)
    rows = table(tmp_path)
    # trial 1 runs while trial 0's lease still holds; then trial 2 takes trial 0 over
    assert [(r["state"], r["resumes"], r["taken_over"]) for r in rows] == [
        ("FAIL", "", "True"), ("COMPLETE", "", "False"), ("COMPLETE", "0", "False")]
    assert rows[2]["run_dir"] == rows[0]["run_dir"]
    assert [p.name for p in second.started] == ["trial-0001", "trial-0000"]
    assert any("lease expired" in line for line in lines)


def test_ctrl_c_then_the_same_command_resumes_the_trial_at_once(tmp_path):
    clock = FakeClock()
    first = FakeRunner(clock, interrupt_at=2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, clock, first, max_trials=2, lease_s=600)
    assert first.running == set()  # its run was stopped
    second = FakeRunner(clock)
    before = clock.now()
    run(tmp_path, clock, second, max_trials=2, lease_s=600)
    rows = table(tmp_path)
    assert [(r["state"], r["resumes"]) for r in rows] == [("FAIL", ""), ("COMPLETE", "0"),
                                                         ("COMPLETE", "")]
    assert rows[1]["lr"] == rows[0]["lr"] and rows[1]["run_dir"] == rows[0]["run_dir"]
    assert [p.name for p in second.started] == ["trial-0000", "trial-0002"]
    assert clock.now() - before < 600  # the lease was given up: no wait for it to expire


def test_budget_hard_stops_the_running_trial(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock)
    lines: list[str] = []
    summary = run(tmp_path, clock, runner, lines, max_trials=0, budget_hours=0.02,
                  budget_hard=True, lease_s=30)
    [row] = table(tmp_path)
    assert row["state"] == "FAIL" and row["note"] == "budget" and runner.running == set()
    assert any("running trials stopped (--budget-hard)" in line for line in lines)
    assert summary["stop"].startswith("budget: ") and "hours spent" in summary["stop"]
    assert len(runner.started) == 1


class _Say(list):
    def __init__(self, hook):
        super().__init__()
        self.hook = hook

    def append(self, line):
        super().append(line)
        self.hook(line)


def test_a_trial_asked_past_max_trials_by_a_race_is_void(tmp_path):
    """Two workers that both saw room for one more trial both ask one: the later (higher
    number) is void, so the study never runs more than --max-trials."""
    from dptrain.tune.search import check_base
    from dptrain.tune.study import open_study, storage_for
    from dptrain.tune.worker import Worker

    options = TuneOptions(out=str(tmp_path / "s"), space=("lr=log:1e-3:1e-1",), max_trials=1,
                          monitor="train_error")
    storage = storage_for(options)
    study = open_study(options, dict(BASE), "train_error", 3, storage=storage)
    clock = FakeClock()
    worker = Worker(study, storage, options, dict(BASE), runner=FakeRunner(clock),
                    monitor="train_error", clock=clock)
    first, second = study.ask(), study.ask()  # both asked before either counted the other
    assert worker._void_reason(first.number, None, None) is None
    assert "past --max-trials" in worker._void_reason(second.number, None, None)
    assert check_base(options, dict(BASE), preflight=False)[1] == "train_error"


def test_grid_runs_each_point_once_and_stops(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock)
    summary = run(tmp_path, clock, runner, space=("lr=choice:0.01,0.02,0.03",), sampler="grid",
                  max_trials=0)
    assert sorted(float(r["lr"]) for r in table(tmp_path)) == [0.01, 0.02, 0.03]
    assert summary["stop"] == "max-trials: 3 of 3 trials run or running"
    assert summary["best"]["params"] == {"lr": 0.01}
