"""One worker of a study: ask a trial, run it, report its epochs, tell its result; again until
--max-trials or a budget says stop. Start the same command on several nodes (or twice on one)
and each pulls its own trials from the shared storage.

    worker = Worker(study, storage, options, base, runner=SubprocessRunner(), monitor="val_error")
    reason = worker.run()          # the line that says why the study stopped

No trial is lost: a worker holds a lease on its running trial, renewed as it runs; a trial whose
lease expired (its worker was killed, its node lost) is taken over by another worker, which
resumes the same run directory with the same options, from its newest checkpoint. The trial
that was taken over is marked FAIL (`taken_over`) and the new one `resumes` it; only the first
counts toward --max-trials.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.tune import budget
from dptrain.tune.clock import Clock
from dptrain.tune.options import TuneOptions
from dptrain.tune.runner import Runner
from dptrain.tune.space import Dimension, parse_space
from dptrain.tune.toml import write_toml

LEASE = "dptrain:lease_until"
EXPECTED_FAILURES = {3: "bad data (exit 3)", 6: "NaN loss (exit 6)", 7: "collapsed (exit 7)"}


class Worker:
    def __init__(self, study: Any, storage: Any, options: TuneOptions, base: dict[str, Any], *,
                 runner: Runner, monitor: str, processes: int = 1, clock: Clock | None = None,
                 poll_s: float = 0.5, say: Callable[[str], None] = print) -> None:
        from optuna.trial import TrialState

        self.study, self.storage, self.options, self.base = study, storage, options, base
        self.runner, self.monitor, self.processes = runner, monitor, processes
        self.clock, self.poll_s, self.say = clock or Clock(), poll_s, say
        self.dims: dict[str, Dimension] = parse_space(options.space)
        self.out = Path(options.out)
        self.name = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.State = TrialState
        started = study.user_attrs.get("started_at")
        if started is None:
            study.set_user_attr("started_at", self.clock.now())
        self.started_at = study.user_attrs.get("started_at", self.clock.now())

    # ------------------------------------------------------------------------------ the loop
    def run(self) -> str:
        """Run trials until the study is done; the line that says why it stopped."""
        while True:
            trials = self._trials()
            if self._take_over_expired(trials):
                trials = self._trials()
            reason = self._stop_reason(trials)
            waiting = any(t.state == self.State.WAITING for t in trials)
            if reason and not waiting:
                if any(t.state == self.State.RUNNING for t in trials):
                    # Another worker's trial: stay to take it over should that worker die.
                    self.clock.sleep(min(self.poll_s * 4, self.options.lease_s / 2))
                    continue
                return reason
            trial = self.study.ask()
            resumes = self._frozen(trial.number).user_attrs.get("resumes")
            void = self._void_reason(trial.number, resumes, reason)
            if void:
                trial.set_user_attr("void", void)
                self.study.tell(trial, state=self.State.FAIL)
                continue
            self._run_trial(trial, resumes)

    def _trials(self) -> list[Any]:
        return self.study.get_trials(deepcopy=False)

    def _trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def _frozen(self, number: int) -> Any:
        return self.storage.get_trial(self._trial_id(number))

    def _max_trials(self) -> int:
        limit = self.options.max_trials
        if self.options.sampler == "grid":
            size = math.prod(len(d.choices) for d in self.dims.values())
            limit = min(limit, size) if limit else size
        return limit

    def _stop_reason(self, trials: list[Any]) -> str | None:
        limit = self._max_trials()
        if limit and sum(budget.counts(t) for t in trials) >= limit:
            return f"max-trials: {limit} of {limit} trials run or running"
        spend = budget.spend(trials, self.clock.now(), self.started_at)
        return budget.stop_line(spend, self.options.budget_hours,
                                self.options.budget_process_hours)

    def _void_reason(self, number: int, resumes: int | None, stop: str | None) -> str | None:
        """Why a trial just asked must not run: past --max-trials (another worker asked first),
        a new trial asked for a waiting one after the search was told to `stop`, or a second
        takeover of the same trial (two workers saw its lease expire at once)."""
        if stop and resumes is None:
            return f"a new trial after the search stopped ({stop})"
        earlier = [t for t in self._trials() if t.number < number and not budget.is_void(t)]
        if resumes is not None:
            if any(t.user_attrs.get("resumes") == resumes for t in earlier):
                return f"trial {resumes} is already resumed by another trial"
            return None
        limit = self._max_trials()
        if limit and sum(budget.counts(t) for t in earlier) >= limit:
            return "asked past --max-trials by a race between workers"
        return None

    # ------------------------------------------------------------------------------ takeover
    def _take_over_expired(self, trials: list[Any]) -> bool:
        now, took = self.clock.now(), False
        for t in trials:
            if t.state != self.State.RUNNING or budget.is_void(t):
                continue
            lease = t.system_attrs.get(LEASE)
            if lease is None and t.datetime_start is not None:  # died before its first lease
                lease = t.datetime_start.timestamp() + self.options.lease_s
            if lease is None or lease > now:
                continue
            trial_id = self._trial_id(t.number)
            if "run_dir" not in t.user_attrs:  # its worker died before it started a run
                self.storage.set_trial_user_attr(trial_id, "void", "its worker died first")
                self._fail(trial_id)
                took = True
                continue
            self.storage.set_trial_user_attr(trial_id, "taken_over", True)
            first = t.user_attrs.get("trial", t.number)  # the chain's first trial
            self.study.enqueue_trial(t.params, user_attrs={"resumes": t.number,
                                                           "trial": first,
                                                           "run_dir": t.user_attrs["run_dir"]},
                                     skip_if_exists=False)
            self._fail(trial_id)
            self.say(f"trial {t.number}: its worker's lease expired {now - lease:.0f} s ago: "
                     f"taken over, resuming {t.user_attrs['run_dir']} from its newest "
                     f"checkpoint")
            took = True
        return took

    def _fail(self, trial_id: int) -> None:
        try:
            self.storage.set_trial_state_values(trial_id, self.State.FAIL)
        except Exception:  # noqa: BLE001 - finished meanwhile (another worker took it over)
            pass

    def _renew(self, trial: Any, started: float) -> bool:
        """Renew the lease and the cost so far; False when the trial was taken over."""
        now = self.clock.now()
        self.storage.set_trial_system_attr(self._trial_id(trial.number), LEASE,
                                           now + self.options.lease_s)
        trial.set_user_attr("wall_s", now - started)
        trial.set_user_attr("process_s", (now - started) * self.processes)
        return self._frozen(trial.number).state == self.State.RUNNING

    # ------------------------------------------------------------------------------ a trial
    def _run_trial(self, trial: Any, resumes: int | None) -> None:
        params = {name: dim.suggest(trial) for name, dim in self.dims.items()}
        first = self._frozen(trial.number).user_attrs.get("trial", trial.number)
        run_dir = self.out / f"trial-{first:04d}"
        config = run_dir / "trial.toml"
        if not config.exists():  # a resumed run keeps the options it started with
            run_dir.mkdir(parents=True, exist_ok=True)
            write_toml(config, {**self.base, **params, "monitor": self.monitor} if
                       self.monitor else {**self.base, **params})
        started = self.clock.now()
        for key, value in (("run_dir", str(run_dir)), ("worker", self.name),
                           ("started_at", started), ("processes", self.processes),
                           ("trial", first)):
            trial.set_user_attr(key, value)
        self._renew(trial, started)
        spend = budget.spend(self._trials(), started, self.started_at)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in params.items())
        verb = f"resumes trial {resumes}" if resumes is not None else "starts"
        self.say(f"trial {trial.number} {verb} ({shown}) in {run_dir} | {self._spent(spend)}")
        process = self.runner.start(run_dir, config)
        try:
            outcome = self._watch(trial, process, run_dir, started)
        except BaseException:
            process.stop()
            # Ctrl-C: the lease ends now, so the same command run again resumes this trial at
            # once (from its newest checkpoint) instead of waiting for the lease to expire.
            self._renew(trial, started)  # its cost up to now
            self.storage.set_trial_system_attr(self._trial_id(trial.number), LEASE, 0.0)
            raise
        self._finish(trial, run_dir, started, resumes, *outcome)

    def _watch(self, trial: Any, process: Any, run_dir: Path, started: float
               ) -> tuple[str, int | None]:
        """Follow the run to its end: report each epoch, prune, renew the lease. ("exit", rc),
        ("pruned", rc), ("taken over", rc) or ("budget", rc)."""
        reported: set[int] = set()
        renewed = started
        while True:
            rc = process.poll()
            for epoch, value in self._new_epochs(run_dir, reported):
                trial.report(value, epoch)
                if rc is None and trial.should_prune():
                    return "pruned", process.stop()
            if rc is not None:
                return "exit", rc
            now = self.clock.now()
            if now - renewed >= self.options.lease_s / 3:
                renewed = now
                if not self._renew(trial, started):
                    return "taken over", process.stop()
                if self.options.budget_hard:
                    spend = budget.spend(self._trials(), now, self.started_at)
                    line = budget.spent_out(spend, self.options.budget_hours,
                                            self.options.budget_process_hours)
                    if line:
                        self.say(line)
                        return "budget", process.stop()
            self.clock.sleep(self.poll_s)

    def _new_epochs(self, run_dir: Path, reported: set[int]) -> list[tuple[int, float]]:
        path = run_dir / "epochs.csv"
        if not path.exists():
            return []
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        new = []
        for row in rows:
            epoch = int(row["epoch"])
            if epoch in reported or not row.get(self.monitor):
                continue
            reported.add(epoch)
            value = float(row[self.monitor])
            if math.isfinite(value):
                new.append((epoch, value))
        return new

    def _finish(self, trial: Any, run_dir: Path, started: float, resumes: int | None,
                how: str, rc: int | None) -> None:
        now = self.clock.now()
        trial.set_user_attr("wall_s", now - started)
        trial.set_user_attr("process_s", (now - started) * self.processes)
        trial.set_user_attr("exit_code", rc)
        epochs = self._epochs_run(run_dir)
        trial.set_user_attr("epochs", epochs)
        if how == "taken over":
            self.say(f"trial {trial.number}: taken over by another worker; its run stopped here")
            return
        if how == "pruned":
            self.study.tell(trial, state=self.State.PRUNED)
            self._said(trial, f"PRUNED after {epochs} epoch(s)")
            return
        if how == "budget":
            trial.set_user_attr("stopped", "budget")
            self.study.tell(trial, state=self.State.FAIL)
            self._said(trial, "stopped by --budget-hard")
            return
        if rc == 0:
            value, why = self._objective(run_dir)
            if value is not None:
                self.study.tell(trial, value)
                self._said(trial, f"{self.monitor} {value:.4g}")
                return
        else:
            why = EXPECTED_FAILURES.get(rc, f"exit {rc}")
        trial.set_user_attr("failure", why)
        self.study.tell(trial, state=self.State.FAIL)
        self._said(trial, f"FAIL: {why}; see {run_dir / 'train.log'}")
        finished = [t for t in self._trials() if t.state in (self.State.COMPLETE,
                                                              self.State.PRUNED)]
        if rc == 2 and not finished and resumes is None:
            raise ConfigError(f"trial {trial.number} refused its options: "
                              f"{last_line(run_dir / 'train.log')}")

    def _objective(self, run_dir: Path) -> tuple[float | None, str]:
        """The run's best monitored value, read from its summary.json under the name the run
        itself recorded; (None, why) when there is none."""
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError) as err:
            return None, f"no readable summary.json ({err})"
        monitor = summary.get("config", {}).get("monitor", self.monitor)
        if monitor.startswith("test_"):
            raise ConfigError(f"the runs monitor {monitor}, a test metric, which cannot choose "
                              f"hyperparameters: pass --monitor a validation metric")
        if self.monitor and monitor != self.monitor:
            return None, f"the run monitored {monitor}, not {self.monitor}"
        value = summary.get(f"best_{monitor}")
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, f"no finite best_{monitor} in summary.json"
        return float(value), ""

    def _epochs_run(self, run_dir: Path) -> int:
        path = run_dir / "epochs.csv"
        if not path.exists():
            return 0
        with open(path, newline="") as f:
            return sum(1 for _ in csv.DictReader(f))

    def _said(self, trial: Any, what: str) -> None:
        trials = self._trials()
        best = self._best(trials)
        best_text = f"best {best.value:.4g} (trial {best.number})" if best else "no best yet"
        done = sum(budget.counts(t) and t.state.is_finished() for t in trials)
        limit = self._max_trials()
        spend = budget.spend(trials, self.clock.now(), self.started_at)
        self.say(f"trial {trial.number} {what} | {best_text} | {done}"
                 f"{f' of {limit}' if limit else ''} trials done | {self._spent(spend)}")

    def _spent(self, spend: budget.Spend) -> str:
        return budget.progress(spend, self.options.budget_hours,
                               self.options.budget_process_hours)

    def _best(self, trials: list[Any]) -> Any:
        done = [t for t in trials if t.state == self.State.COMPLETE and t.value is not None]
        if not done:
            return None
        pick = max if self.study.direction.name == "MAXIMIZE" else min
        return pick(done, key=lambda t: t.value)


def last_line(path: Path) -> str:
    """The last non-empty line of a run's log (its one-line error)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"
