"""A study's results in its directory: trials.csv (one row per trial), best.toml (the best
trial's options, for `dptrain train --config`), tune.png and study.json (the stop line too).
Any worker may write them; each file is replaced whole."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from dptrain.learners.plots import pyplot
from dptrain.tune import budget
from dptrain.tune.toml import write_toml

COLUMNS = ("number", "state", "value", "epochs", "process_hours", "run_dir", "resumes",
           "taken_over", "note")


def rows(trials: list[Any], names: list[str], now: float) -> list[dict[str, Any]]:
    out = []
    for t in trials:
        if budget.is_void(t):
            continue
        a = t.user_attrs
        note = a.get("failure") or a.get("stopped") or ""
        row = {"number": t.number, "state": t.state.name, "value": t.value,
               "epochs": a.get("epochs", ""), "process_hours": round(budget.cost_s(t, now)[0]
                                                                     / 3600, 6),
               "run_dir": a.get("run_dir", ""), "resumes": a.get("resumes", ""),
               "taken_over": bool(a.get("taken_over")), "note": note}
        row.update({n: t.params.get(n, "") for n in names})
        out.append(row)
    return out


def best_trial(study: Any) -> Any:
    done = [t for t in study.get_trials(deepcopy=False)
            if t.state.name == "COMPLETE" and t.value is not None]
    if not done:
        return None
    pick = max if study.direction.name == "MAXIMIZE" else min
    return pick(done, key=lambda t: t.value)


def write_results(study: Any, out: Path, base: dict[str, Any], names: list[str],
                  monitor: str, now: float, stop: str) -> dict[str, Any]:
    """Write every result file; the study summary (also study.json)."""
    trials = study.get_trials(deepcopy=False)
    table = rows(trials, names, now)
    tmp = out / f".trials.csv.{os.getpid()}.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS[:2], *names, *COLUMNS[2:]])
        writer.writeheader()
        writer.writerows(table)
    os.replace(tmp, out / "trials.csv")
    best = best_trial(study)
    if best is not None:
        write_toml(out / "best.toml", {**base, **best.params, **({"monitor": monitor}
                                                                  if monitor else {})},
                   header=f"trial {best.number}: {monitor or 'objective'} {best.value:.6g} "
                          f"({best.user_attrs.get('run_dir', '')})\n"
                          f"dptrain train --config best.toml")
    plot(out / "tune.png", table, names, monitor, study.direction.name == "MAXIMIZE")
    states = [r["state"] for r in table]
    summary = {
        "study": study.study_name, "monitor": monitor, "direction": study.direction.name.lower(),
        "trials": len(table), **{s.lower(): states.count(s) for s in
                                 ("COMPLETE", "PRUNED", "FAIL", "RUNNING")},
        "process_hours": sum(r["process_hours"] for r in table),
        "best": None if best is None else {"number": best.number, "value": best.value,
                                           "params": best.params,
                                           "run_dir": best.user_attrs.get("run_dir")},
        "stop": stop,
    }
    tmp = out / f".study.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, out / "study.json")
    return summary


def plot(path: Path, table: list[dict[str, Any]], names: list[str], monitor: str,
         maximize: bool) -> bool:
    """Value per trial with the best so far, then each parameter against the value."""
    plt = pyplot()
    done = [r for r in table if r["state"] == "COMPLETE" and r["value"] is not None
            and math.isfinite(r["value"])]
    if plt is None or not done:
        return False
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(4.5 * (1 + len(names)), 3.5),
                             squeeze=False)
    ax = axes[0][0]
    numbers, values = [r["number"] for r in done], [r["value"] for r in done]
    best, so_far = [], None
    for v in values:
        so_far = v if so_far is None else (max if maximize else min)(so_far, v)
        best.append(so_far)
    ax.plot(numbers, values, "o", label="trial")
    ax.step(numbers, best, where="post", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(monitor or "objective")
    ax.legend()
    for ax, name in zip(axes[0][1:], names):
        xs = [r[name] for r in done]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
            ax.plot(xs, values, "o")
            if all(x > 0 for x in xs) and max(xs) / min(xs) > 20:
                ax.set_xscale("log")
        else:
            labels = sorted(set(map(str, xs)))
            ax.plot([labels.index(str(x)) for x in xs], values, "o")
            ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
