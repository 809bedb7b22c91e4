"""Where a study lives and what it is: its storage (a journal file in the study directory, or
PostgreSQL), its sampler and pruner, and `tune.json`, the record that keeps one study per
directory.

    study = open_study(options, base={"model": "tagi-mlp"}, monitor="val_error")
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.tune.options import STUDY_KEYS, TuneOptions
from dptrain.tune.space import grid, parse_space

INSTALL_HINT = "dptrain tune needs Optuna: pip install 'dptrain[tune]'"


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").propagate = True
    return optuna


def storage_for(options: TuneOptions) -> Any:
    """The study's storage; an unreachable database is one line."""
    optuna = import_optuna()
    if not options.storage:
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        Path(options.out).mkdir(parents=True, exist_ok=True)
        path = str(Path(options.out) / "study.journal")
        # An open(O_EXCL) lock file works on NFS too, where a study shared by nodes lives.
        return optuna.storages.JournalStorage(JournalFileBackend(path, JournalFileOpenLock(path)))
    url = options.storage
    if url.startswith("postgresql://"):  # the driver of the extra (psycopg 3)
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    for attempt in range(3):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs={
                "pool_pre_ping": True, "connect_args": {"connect_timeout": 10}})
        except Exception as err:  # noqa: BLE001 - SQLAlchemy's and the driver's many kinds
            # Workers that start together race to create the tables: the loser tries again.
            if attempt == 2 or "connect" in str(err).lower():
                first = str(err).strip().splitlines()[0] if str(err).strip() else \
                    type(err).__name__
                raise ConfigError(f"--storage {options.storage}: cannot be used: {first}"
                                  ) from None
            time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


def make_sampler(options: TuneOptions) -> Any:
    optuna = import_optuna()
    seed = None if options.sampler_seed < 0 else options.sampler_seed
    if options.sampler == "grid":
        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, *args: Any, **kwargs: Any) -> None:
                # Optuna's grid stops the study here once every point is taken, which only
                # optimize() allows (ask-and-tell raises); --max-trials is capped at the grid's
                # size instead (worker.py).
                pass

        return Grid(grid(parse_space(options.space)), seed=seed)
    if options.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(options: TuneOptions, epochs: int) -> Any:
    pruners = import_optuna().pruners
    if options.pruner == "halving":
        return pruners.SuccessiveHalvingPruner()
    if options.pruner == "hyperband":
        return pruners.HyperbandPruner(min_resource=1, max_resource=max(epochs, 1))
    if options.pruner == "median":
        return pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    return pruners.NopPruner()


def study_record(options: TuneOptions, base: dict[str, Any]) -> dict[str, Any]:
    """What defines the study: the runs' base options and the search's own (STUDY_KEYS)."""
    record = {key: getattr(options, key) for key in STUDY_KEYS}
    record["space"] = sorted(record["space"])
    return {"base": {k: base[k] for k in sorted(base)}, **record}


def claim_directory(options: TuneOptions, base: dict[str, Any]) -> None:
    """Write tune.json in a new study directory; refuse one that holds another study's."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tune.json"
    record = json.loads(json.dumps(study_record(options, base)))  # tuples as lists
    if path.exists():
        held = json.loads(path.read_text())
        changed = [key for key in sorted(set(held) | set(record)) if held.get(key) !=
                   record.get(key)]
        changed += [f"base.{k}" for k in sorted(set(held.get("base", {})) |
                                               set(record["base"]))
                    if held.get("base", {}).get(k) != record["base"].get(k)]
        changed = [c for c in changed if c != "base"]
        if changed:
            raise ConfigError(f"{out} holds another study (its {', '.join(changed)} differ, see "
                              f"{path}): use another --out, or the same options to continue it")
        return
    tmp = out / f".tune.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def open_study(options: TuneOptions, base: dict[str, Any], monitor: str, epochs: int,
               storage: Any, pruner: Any = None) -> Any:
    """Create the study, or load it when it exists (another worker's, or an earlier run's)."""
    optuna = import_optuna()
    claim_directory(options, base)
    name = options.study_name or Path(options.out).resolve().name
    direction = "maximize" if "log_likelihood" in monitor else "minimize"
    study = optuna.create_study(storage=storage, study_name=name, direction=direction,
                                sampler=make_sampler(options),
                                pruner=pruner if pruner is not None else make_pruner(options,
                                                                                      epochs),
                                load_if_exists=True)
    if study.direction.name.lower() != direction:
        raise ConfigError(f"study {name!r} in {options.storage or options.out} was made to "
                          f"{study.direction.name.lower()}, not {direction} {monitor}")
    return study
