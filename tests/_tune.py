"""A fake trial runner for the search's own logic (leases, budget, --max-trials): each "run"
writes what `dptrain train` writes (epochs.csv row by row, then summary.json) as a FakeClock
advances, without a process."""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

from dptrain.tune.clock import FakeClock


class FakeRun:
    def __init__(self, runner: FakeRunner, run_dir: Path, options: dict) -> None:
        self.runner, self.run_dir, self.options = runner, run_dir, options
        self.start = runner.clock.now()
        self.rc: int | None = None
        self.stopped = False

    def _value(self, epoch: int) -> float:
        return float(self.options.get("lr", 0.1)) + 1.0 / epoch

    def poll(self) -> int | None:
        if self.rc is not None or self.stopped:
            return self.rc
        epochs = int(self.options.get("epochs", 3))
        done = min(epochs, int((self.runner.clock.now() - self.start) / self.runner.epoch_s))
        if self.runner.interrupt_at is not None and done >= self.runner.interrupt_at:
            self.runner.interrupt_at = None
            raise KeyboardInterrupt  # Ctrl-C while the worker watches this run
        rows = [{"epoch": e, "step": e, "train_error": self._value(e)} for e in
                range(1, done + 1)]
        if rows:
            with open(self.run_dir / "epochs.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        if done == epochs:
            self.rc = self.runner.exit_codes.pop(0) if self.runner.exit_codes else 0
            if self.rc == 0:
                (self.run_dir / "summary.json").write_text(json.dumps(
                    {"best_train_error": min(r["train_error"] for r in rows),
                     "config": {"monitor": "train_error"}}))
        return self.rc

    def stop(self) -> int:
        self.stopped = True
        self.rc = -15
        self.runner.running.discard(self)
        return self.rc


class FakeRunner:
    """Runs finish after `epochs` x `epoch_s` fake seconds; `exit_codes` pops one per run;
    `interrupt_at`: Ctrl-C once a run has written that many epochs."""

    def __init__(self, clock: FakeClock, epoch_s: float = 60.0,
                 exit_codes: list[int] | None = None, interrupt_at: int | None = None) -> None:
        self.clock, self.epoch_s, self.interrupt_at = clock, epoch_s, interrupt_at
        self.exit_codes = list(exit_codes or [])
        self.started: list[Path] = []
        self.running: set[FakeRun] = set()

    def start(self, run_dir: Path, config: Path) -> FakeRun:
        self.started.append(run_dir)
        run = FakeRun(self, run_dir, tomllib.loads(config.read_text()))
        self.running.add(run)
        return run
