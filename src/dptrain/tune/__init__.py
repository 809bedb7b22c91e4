"""Hyperparameter search of data-parallel runs on Optuna (the optional extra `dptrain[tune]`).

    from dptrain.tune import TuneOptions, tune

    summary = tune(TuneOptions(out="runs/search", space=("lr=log:1e-4:1e-1",
                                                         "batch_size=choice:32,64"),
                               monitor="val_error", max_trials=20, budget_process_hours=12),
                   base={"model": "torch-mlp", "dataset": "digits", "nproc": 2, "epochs": 10})

Each trial is one `dptrain train` run in `<out>/trial-NNNN/`, started as a process of its own;
the search asks Optuna for a trial, runs it, reports its epochs.csv as intermediate values (for
pruning) and tells Optuna the run's best monitored value (ask and tell: the training processes
never import Optuna). Several workers (the same call on several nodes) share one study.
"""

from dptrain.tune.clock import Clock, FakeClock
from dptrain.tune.options import TuneOptions
from dptrain.tune.runner import Runner, SubprocessRunner, TrialProcess
from dptrain.tune.search import tune
from dptrain.tune.space import Dimension, parse_space

__all__ = ["Clock", "Dimension", "FakeClock", "Runner", "SubprocessRunner", "TrialProcess",
           "TuneOptions", "parse_space", "tune"]
