"""What a study has spent and whether the next trial fits: pure functions of the study's trials
and the time now, so every worker, on any node, decides the same from the same storage.

A trial's cost is processes x wall seconds (what a cluster bills), recorded by its worker as it
runs (`process_s`, renewed with its lease). A trial is launched only if the spend, plus what
the running trials are still expected to cost, plus the median cost of a finished trial, fits.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

FINISHED = ("COMPLETE", "PRUNED", "FAIL")


def is_void(trial: Any) -> bool:
    """A trial record that stands for no run (one asked past --max-trials by a race)."""
    return "void" in trial.user_attrs


def counts(trial: Any) -> bool:
    """A trial that takes one of --max-trials (a run taken over keeps its first trial's)."""
    return not is_void(trial) and "resumes" not in trial.user_attrs


def cost_s(trial: Any, now: float) -> tuple[float, float]:
    """(process-seconds, wall seconds) a trial has cost: for a running one, up to `now`."""
    attrs = trial.user_attrs
    process_s, wall_s = attrs.get("process_s", 0.0), attrs.get("wall_s", 0.0)
    if trial.state.name == "RUNNING" and "started_at" in attrs:
        wall_s = max(wall_s, now - attrs["started_at"])
        process_s = max(process_s, wall_s * attrs.get("processes", 1))
    return process_s, wall_s


@dataclass(frozen=True)
class Spend:
    process_h: float
    """Process-hours spent, running trials up to now included."""
    wall_h: float
    """Hours since the study started."""
    next_process_h: float
    """A finished trial's median process-hours (0 before any finished)."""
    next_wall_h: float
    pending_process_h: float
    """What the running trials are still expected to cost (the median less what they spent)."""


def spend(trials: list[Any], now: float, started_at: float) -> Spend:
    live = [t for t in trials if not is_void(t)]
    costs = [cost_s(t, now) for t in live]
    done = [cost_s(t, now) for t in live if t.state.name in ("COMPLETE", "PRUNED")]
    median_p = statistics.median(c[0] for c in done) if done else 0.0
    median_w = statistics.median(c[1] for c in done) if done else 0.0
    pending = sum(max(0.0, median_p - c[0]) for t, c in zip(live, costs)
                  if t.state.name == "RUNNING")
    return Spend(process_h=sum(c[0] for c in costs) / 3600,
                 wall_h=max(0.0, now - started_at) / 3600,
                 next_process_h=median_p / 3600, next_wall_h=median_w / 3600,
                 pending_process_h=pending / 3600)


def _h(hours: float) -> str:
    if hours >= 1:
        return f"{hours:.1f}"
    return f"{hours:.3g}" if hours >= 0.001 or hours == 0 else "<0.001"


def stop_line(s: Spend, budget_hours: float, budget_process_hours: float) -> str | None:
    """The one line that says why the next trial is not launched, or None when it fits."""
    if budget_process_hours and \
            s.process_h + s.pending_process_h + s.next_process_h > budget_process_hours:
        return (f"budget: {_h(s.process_h)} of {_h(budget_process_hours)} process-hours spent; "
                f"next trial ≈ {_h(s.next_process_h)}: not launched")
    if budget_hours and s.wall_h + s.next_wall_h > budget_hours:
        return (f"budget: {_h(s.wall_h)} of {_h(budget_hours)} hours spent; next trial ≈ "
                f"{_h(s.next_wall_h)}: not launched")
    return None


def spent_out(s: Spend, budget_hours: float, budget_process_hours: float) -> str | None:
    """With --budget-hard: the line that stops the running trials, once a budget is spent."""
    if budget_process_hours and s.process_h >= budget_process_hours:
        return (f"budget: {_h(s.process_h)} of {_h(budget_process_hours)} process-hours spent: "
                f"running trials stopped (--budget-hard)")
    if budget_hours and s.wall_h >= budget_hours:
        return (f"budget: {_h(s.wall_h)} of {_h(budget_hours)} hours spent: running trials "
                f"stopped (--budget-hard)")
    return None


def progress(s: Spend, budget_hours: float, budget_process_hours: float) -> str:
    """The spend for the progress line: process-hours (of the budget), wall hours."""
    of_p = f" of {_h(budget_process_hours)}" if budget_process_hours else ""
    of_w = f" of {_h(budget_hours)}" if budget_hours else ""
    return (f"spent {_h(s.process_h)}{of_p} process-hours, {_h(s.wall_h)}{of_w} h; a trial "
            f"≈ {_h(s.next_process_h)} process-hours")
