"""A whole search, from Python or `dptrain tune`: check the options, open the study, run one
worker until the study is done, write the results.

    from dptrain.tune import TuneOptions, tune

    summary = tune(TuneOptions(out="runs/search", space=("lr=log:1e-4:1e-1",),
                               monitor="val_error", max_trials=8),
                   base={"model": "tagi-mlp", "dataset": "digits", "nproc": 2, "epochs": 5})
    summary["best"]["run_dir"]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.learners.build import model_defaults
from dptrain.options import flag
from dptrain.tune.clock import Clock
from dptrain.tune.options import TuneOptions
from dptrain.tune.results import write_results
from dptrain.tune.runner import Runner, SubprocessRunner
from dptrain.tune.space import parse_space
from dptrain.tune.study import import_optuna, open_study, storage_for
from dptrain.tune.worker import Worker
from dptrain.train.job import check_monitor, load_job_split, monitor_of
from dptrain.train.options import TrainOptions


def resolve_monitor(options: TuneOptions, train: TrainOptions, *, check: bool) -> str:
    """The runs' monitored metric: --monitor (checked against what the runs report, when
    `check`), else the runs' own default, refused when it is a test metric."""
    if not check:
        return options.monitor

    split = load_job_split(train)
    check_monitor(train, split)
    monitor = options.monitor or monitor_of(train, split)
    if not monitor:
        raise ConfigError("the runs have no validation part, so nothing to choose by: pass "
                          "--monitor a validation (or training) metric, or a --val-size")
    if monitor.startswith("test_"):
        raise ConfigError(f"the runs monitor {monitor} by default, a test metric, which cannot "
                          f"choose hyperparameters (validation chooses, test reports): pass "
                          f"--monitor a validation (or training) metric")
    return monitor


def check_base(options: TuneOptions, base: dict[str, Any], *, preflight: bool) -> tuple[
        TrainOptions, str]:
    """The runs' options with each dimension at its low end or first choice resolve (a bad
    base option is one line here, before any run starts); the monitored metric."""
    dims = parse_space(options.space)
    shared = sorted(set(dims) & set(base))
    if shared:
        raise ConfigError(f"{', '.join(map(flag, shared))} is both given and searched: give it "
                          f"one way")
    if "monitor" in base and options.monitor and base["monitor"] != options.monitor:
        raise ConfigError("monitor given twice with different values")
    first = {d.name: d.choices[0] if d.kind == "choice" else
             (int(d.low) if d.kind == "int" else d.low) for d in dims.values()}
    merged = {**base, **first, "monitor": options.monitor}
    defaults = model_defaults(merged.get("model", TrainOptions.model),
                              merged.get("dataset", TrainOptions.dataset))
    train = TrainOptions(**{**defaults, **merged})
    return train, resolve_monitor(options, train, check=preflight)


def tune(options: TuneOptions, base: dict[str, Any], *, runner: Runner | None = None,
         clock: Clock | None = None, pruner: Any = None, storage: Any = None,
         preflight: bool = True, poll_s: float = 0.5,
         say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one worker of the study until it is done; the study summary (study.json).
    `base`: the runs' options (dptrain train's keys) the search does not vary."""
    import_optuna()
    base = {k: v for k, v in base.items() if k not in ("out", "progress", "resume")}
    if "monitor" in base and not options.monitor:
        options = replace(options, monitor=base.pop("monitor"))
        TuneOptions.__post_init__(options)
    base.pop("monitor", None)
    train, monitor = check_base(options, base, preflight=preflight)
    storage = storage if storage is not None else storage_for(options)
    study = open_study(options, base, monitor, train.epochs, pruner=pruner, storage=storage)
    clock = clock or Clock()
    worker = Worker(study, storage, options, base,
                    runner=runner or SubprocessRunner(), monitor=monitor,
                    processes=train.nproc * train.nodes.max_nodes, clock=clock, poll_s=poll_s,
                    say=say)
    out = Path(options.out)
    names = list(parse_space(options.space))
    stop = ""
    try:
        stop = worker.run()
        say(stop)
    finally:
        summary = write_results(study, out, base, names, monitor, clock.now(), stop)
    best = summary["best"]
    if best:
        say(f"best: trial {best['number']}, {monitor} {best['value']:.4g}, run directory "
            f"{best['run_dir']}; its options: {out / 'best.toml'} (dptrain train --config); "
            f"all trials: {out / 'trials.csv'}, {out / 'tune.png'}")
    return summary
