"""The options of a search (`dptrain tune`), declared once on the fields of `TuneOptions`: the
command line takes its flags from them, a TOML file's `[tune]` table its keys.

    TuneOptions(out="runs/search", space=("lr=log:1e-4:1e-1",), max_trials=20)

The options of the runs themselves are `dptrain train`'s (`TrainOptions`), given beside these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dptrain.errors import ConfigError
from dptrain.options import bad_value, check_at_least, cli, resumable
from dptrain.tune.space import grid, parse_space

STUDY_KEYS = ("space", "sampler", "pruner", "monitor", "study_name")
"""What defines a study besides the runs' base options: a study directory holding another
study's values of these is refused."""


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """How to search: the space, the sampler and pruner, where the study lives, when to stop."""

    out: str = field(default="", metadata=cli(metavar="DIR"))
    """Study directory: trial-NNNN/ run directories, study.journal, trials.csv, best.toml,
    tune.png, study.json."""
    space: tuple[str, ...] = field(default=(), metadata=cli(metavar="KEY=KIND:ARGS"))
    """A searched option of dptrain train: KEY=log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or
    choice:A,B,...; repeat for each (TOML: a [space] table)."""
    monitor: str = ""
    """The runs' monitored metric, whose best value is a trial's objective (maximised for a
    *log_likelihood* metric, else minimised); empty: the runs' own default. Never a test_*
    metric: validation chooses, test reports."""
    sampler: Literal["tpe", "random", "grid"] = field(default="tpe", metadata=cli(choices=True))
    """How the next trial's options are drawn (grid: choice dimensions only)."""
    pruner: Literal["halving", "hyperband", "median", "none"] = field(
        default="halving", metadata=cli(choices=True))
    """Stops unpromising runs early from their per-epoch values (successive halving,
    Hyperband, median)."""
    storage: str = field(default="", metadata=resumable(metavar="URL"))
    """Where the study lives: empty: a journal file in the study directory (shared by several
    nodes only on a filesystem they all see); postgresql://USER@HOST/DB for many nodes."""
    study_name: str = ""
    """Name of the study in its storage; empty: the study directory's name."""
    max_trials: int = field(default=20, metadata=resumable())
    """Trials of the study, counted over every worker, running ones included (0: no limit)."""
    budget_hours: float = field(default=0.0, metadata=resumable())
    """Wall-clock hours from the study's start after which no trial is launched (0: none)."""
    budget_process_hours: float = field(default=0.0, metadata=resumable())
    """Process-hours (processes x wall hours, summed over trials) after which no trial is
    launched (0: none)."""
    budget_hard: bool = field(default=False, metadata=resumable())
    """Also stop the running trials when a budget is spent (else they finish)."""
    lease_s: float = field(default=60.0, metadata=resumable())
    """A running trial whose worker has not renewed its lease for this many seconds is taken
    over by another worker and resumed from its newest checkpoint."""
    sampler_seed: int = field(default=-1, metadata=resumable())
    """Seed of the sampler (-1: drawn afresh)."""

    def __post_init__(self) -> None:
        check_at_least(self, ("max_trials",), 0)
        for name in ("budget_hours", "budget_process_hours"):
            if getattr(self, name) < 0:
                raise bad_value(self, name, "hours >= 0")
        if self.lease_s <= 0:
            raise bad_value(self, "lease_s", "seconds > 0")
        if not self.out:
            raise ConfigError("out DIR is needed: the study directory (trial run directories, "
                              "the journal, the results)")
        if not self.space:
            raise ConfigError("no search space: give --space KEY=KIND:ARGS (or a [space] table "
                              "in the TOML file)")
        dims = parse_space(self.space)
        if self.sampler == "grid":
            grid(dims)
        if self.monitor.startswith("test_"):
            raise ConfigError(f"--monitor {self.monitor}: a test metric cannot choose "
                              f"hyperparameters (validation chooses, test reports); monitor a "
                              f"validation or training metric")
        if self.storage.startswith("sqlite"):
            raise ConfigError(f"--storage {self.storage}: SQLite breaks when several workers "
                              f"write it (Optuna's FAQ); use the default journal file or "
                              f"postgresql://")
        if self.storage and not self.storage.startswith(("postgresql", "mysql")):
            raise ConfigError(f"--storage {self.storage!r}: expected postgresql://... (or "
                              f"empty: a journal file in the study directory)")

    @property
    def direction(self) -> Literal["minimize", "maximize"]:
        return "maximize" if "log_likelihood" in self.monitor else "minimize"
