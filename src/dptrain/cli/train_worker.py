"""One process of `dptrain train`: build the data, the learner and the Trainer, and fit."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from dptrain.cli.train_options import TrainOptions, run_record
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
from dptrain.learners import TorchLearner
from dptrain.learners.models import ModelOptions, check_input, get_model, num_outputs
from dptrain.learners.models import build_model as build_registered
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.learners.user_model import is_model_file, load_user_model
from dptrain.train import FailAt, TrainConfig, Trainer
from dptrain.train.faults import ENV_VAR as FAIL_AT_ENV
from dptrain.train.rng import seed_everything


def _model_options(options: TrainOptions) -> ModelOptions:
    return ModelOptions(hidden=options.hidden, dropout=options.dropout, width=options.width,
                        gain_weight=options.gain or None, gain_bias=options.gain_bias or None,
                        dtype=torch.float64 if options.precision == "64" else torch.float32,
                        heteroscedastic=options.heteroscedastic)


def build_model(options: TrainOptions, split: Split) -> tuple[Any, str]:
    """(model, "tagi" | "torch") for this dataset, initialised from `options.seed` (the same on
    every rank). Every mismatch between model and data is a one-line ConfigError."""
    from dptrain.tagi import manual_seed

    classification = split.task == "classification"
    if options.heteroscedastic and classification:
        raise ConfigError(f"--heteroscedastic is for regression; dataset {options.dataset} "
                          f"is a classification task")
    if options.heteroscedastic and options.model in ("tagi-cnn", "tagi-resnet18"):
        raise ConfigError(f"--heteroscedastic needs a (mean, noise) output pair per target: "
                          f"tagi-mlp or your own model file have it, {options.model} does not")
    if is_model_file(options.model):
        built = load_user_model(options.model, split.input_shape, task=split.task,
                                num_classes=split.num_classes,
                                num_targets=None if classification else split.output_dim,
                                seed=options.seed, heteroscedastic=options.heteroscedastic)
        model, kind = built.model, built.kind
        if kind == "tagi" and options.precision == "64":
            model.to(torch.float64)
    else:
        kind = get_model(options.model).kind
        width = num_outputs(kind, split.task, split.num_classes,
                            None if classification else split.output_dim)
        try:
            check_input(options.model, split.input_shape)
        except ConfigError as err:
            raise ConfigError(f"dataset {options.dataset}: {err}") from None
        seed_everything(options.seed)
        manual_seed(options.seed)
        model = build_registered(options.model, split.input_shape, width,
                                 _model_options(options))
    if kind == "tagi" and options.precision not in ("32", "64"):
        raise ConfigError(f"precision {options.precision} is for torch models; {options.model} "
                          f"is a TAGI model (32 or 64)")
    if kind == "torch" and (options.precision == "64" or options.heteroscedastic):
        raise ConfigError(f"{options.model} is a torch model: precision 64 and "
                          f"--heteroscedastic are for TAGI models")
    return model, kind


def build_learner(options: TrainOptions, split: Split):
    """The learner the options name, initialised from `options.seed` (same on every rank)."""
    model, kind = build_model(options, split)
    if kind == "tagi":
        y_scale = split.y_norm.std if split.y_norm is not None else None
        return TagiLearner(model, task=split.task, num_classes=split.num_classes,
                           sigma_v=options.sigma_v, sigma_v_min=options.sigma_v_min,
                           sigma_v_decay=options.sigma_v_decay, average=options.average,
                           y_scale=y_scale, heteroscedastic=options.heteroscedastic)
    classification = split.task == "classification"
    loss = torch.nn.CrossEntropyLoss() if classification else torch.nn.MSELoss()
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                        for m in model.modules())
    return TorchLearner(model, loss, functools.partial(torch.optim.Adam, lr=options.lr),
                        precision=options.precision, strategy=options.strategy,
                        accumulation_steps=options.accumulation_steps,
                        sync_batchnorm=has_batchnorm)


def load_split(options: TrainOptions) -> Split:
    """The dataset, with training-image augmentation as the options ask."""
    split = load_dataset(options.dataset)
    augment = options.augment == "on" or (options.augment == "auto" and
                                          split.name == "cifar10")
    if augment:
        if not hasattr(split.train, "with_augmentation"):
            raise ConfigError(f"--augment is for image datasets (mnist, cifar10); "
                              f"{options.dataset} has inputs {split.input_shape}")
        split = split.with_train(split.train.with_augmentation(seed=options.seed))
    return split


def preflight(options: TrainOptions) -> None:
    """Load the data and build the model once, so that bad input fails before workers start."""
    split = load_split(options)
    build_model(options, split)


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
    split = load_split(options)
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
