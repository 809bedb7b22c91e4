"""One process of `dptrain train`: build the data, the learner and the Trainer, and fit."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from dptrain.cli.train_options import TAGI_MODELS, TrainOptions, run_record
from dptrain.cli.worker import (
    exit_interrupted,
    exit_with_expected_error,
    exit_without_teardown,
    is_expected,
)
from dptrain.data import Split, load_dataset
from dptrain.dist import (
    Runtime,
    broadcast_object,
    distributed,
    get_rank,
    rank_zero_print,
    setup_logging,
)
from dptrain.dist.job import launcher_start_time, stamp
from dptrain.errors import ConfigError, DptrainError
from dptrain.learners.tagi_learner import TagiLearner, tagi_mlp
from dptrain.train import FailAt, TrainConfig, Trainer
from dptrain.train.faults import ENV_VAR as FAIL_AT_ENV
from dptrain.train.rng import seed_everything


def build_learner(options: TrainOptions, split: Split):
    """The learner the options name, initialised from `options.seed` (same on every rank)."""
    seed_everything(options.seed)
    if options.model in TAGI_MODELS:
        from dptrain.tagi import HRCSoftmax, manual_seed

        if len(split.input_shape) != 1:
            raise ConfigError(f"model {options.model} takes flat inputs; dataset "
                              f"{options.dataset} has shape {split.input_shape} (use e.g. "
                              f"digits instead of digits-image)")
        manual_seed(options.seed)
        classification = split.task == "classification"
        out_dim = HRCSoftmax(split.num_classes).num_outputs if classification \
            else split.output_dim
        dtype = torch.float64 if options.precision == "64" else torch.float32
        if options.heteroscedastic and classification:
            raise ConfigError(f"--heteroscedastic is for regression; dataset {options.dataset} "
                              f"is a classification task")
        model = tagi_mlp(split.input_shape[0], out_dim, hidden=options.hidden,
                         heteroscedastic=options.heteroscedastic, dtype=dtype)
        y_scale = split.y_norm.std if split.y_norm is not None else None
        return TagiLearner(model, task=split.task, num_classes=split.num_classes,
                           sigma_v=options.sigma_v, average=options.average, y_scale=y_scale,
                           heteroscedastic=options.heteroscedastic)
    from dptrain.learners.recipes import make_learner

    if split.task != "classification" or split.num_classes != 10 or \
            split.input_shape not in ((64,), (1, 8, 8)):
        raise ConfigError(f"model {options.model} is built for the 8x8 digits (64 inputs, 10 "
                          f"classes); dataset {options.dataset} is {split!r}")
    recipe = {"lr": options.lr, **({"hidden": options.hidden, "dropout": options.dropout}
                                   if options.model == "torch-mlp" else {})}
    return make_learner(options.model, recipe_options=recipe, precision=options.precision,
                        strategy=options.strategy,
                        accumulation_steps=options.accumulation_steps)


def train_config(options: TrainOptions, split: Split) -> TrainConfig:
    classification = split.task == "classification"
    fail_at = options.fail_at or os.environ.get(FAIL_AT_ENV, "")
    return TrainConfig(
        out_dir=Path(options.out), num_epochs=options.epochs, batch_size=options.batch_size,
        seed=options.seed, checkpoint_every=options.checkpoint_every or None,
        keep_last=options.keep_last, resume=options.resume,
        monitor=options.monitor or ("test_error" if classification else "test_rmse"),
        monitor_mode="max" if "log_likelihood" in options.monitor else "min",
        patience=options.patience or None, progress=options.progress,
        fail_at=FailAt.parse(fail_at) if fail_at else None, record=dict(vars(options)),
        run_record=run_record(options))


def agreed_run_dir(options: TrainOptions, started_at: float) -> str:
    """Rank 0's run directory, named after `started_at`, on every rank (collective)."""
    from dptrain.cli.train import run_dir

    return broadcast_object(run_dir(options, stamp(started_at)) if get_rank() == 0 else None)


def run_training(options: TrainOptions) -> dict:
    with distributed(timeout=timedelta(seconds=options.timeout)) as runtime:
        if not options.out:
            # A launcher that names no job: rank 0 decides. Under torchrun its agent's start
            # time, which the restarted attempts share, so they find the directory again.
            started = launcher_start_time() if runtime.env.launcher == "torchrun" else None
            options = replace(options, out=agreed_run_dir(options, started or time.time()))
        setup_logging(runtime.env.rank)
        logging.getLogger("dptrain").setLevel(logging.WARNING)
        return _fit(options, runtime)


def _fit(options: TrainOptions, runtime: Runtime) -> dict:
    split = load_dataset(options.dataset)
    learner = build_learner(options, split)
    config = train_config(options, split)
    rank_zero_print(f"dptrain train: {options.model} on {split!r}, {runtime.env.world_size} "
                    f"process(es) ({runtime.env.launcher}, {runtime.backend or 'no group'}), "
                    f"global batch {options.batch_size}, run directory {options.out}")
    summary = Trainer(learner, split, config, runtime).fit()
    rank_zero_print(f"done: {_headline(summary, split)} after {summary['final_epoch']} "
                    f"epoch(s), {summary['samples_per_s']:.0f} samples/s, "
                    f"{summary['wall_time_s']:.1f} s\n"
                    f"run directory: {options.out} (summary.json, epochs.csv, "
                    f"learning_curves.png, checkpoints/; TensorBoard: tensorboard --logdir "
                    f"{Path(options.out) / 'tb'})")
    return summary


def _headline(summary: dict, split: Split) -> str:
    """The test metric users look at first, with how calibrated the predictions are."""
    def pct(key: str, digits: int = 1) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{100 * value:.{digits}f} %"

    if split.task == "classification":
        shown = f"test_error {pct('test_error', 2)}"
        if summary.get("test_ece") is not None:
            shown += f", ECE {summary['test_ece']:.3f}"
        return shown
    shown = f"test_rmse {summary.get('test_rmse', float('nan')):.4g}"
    if summary.get("test_log_likelihood") is not None:
        shown += f", log-likelihood {summary['test_log_likelihood']:.4g}"
    if summary.get("test_coverage_2sigma") is not None:
        shown += (f", interval coverage 1σ {pct('test_coverage_1sigma')} / 2σ "
                  f"{pct('test_coverage_2sigma')} / 3σ {pct('test_coverage_3sigma')}")
    return shown


@record
def main() -> None:
    options = TrainOptions.from_json(Path(sys.argv[1]).read_text())
    try:
        run_training(options)
    except DptrainError as err:
        if not is_expected(err):
            raise
        exit_with_expected_error(err, "train")
    except KeyboardInterrupt:
        exit_interrupted()
    exit_without_teardown(0)  # see there: torch can abort a finished worker in teardown


if __name__ == "__main__":
    main()
