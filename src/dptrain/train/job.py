"""One process of a `dptrain train` job: the data, the learner and the Trainer its options name.

    from dptrain.train.job import run_training
    from dptrain.train.options import TrainOptions

    summary = run_training(TrainOptions(nproc=1, epochs=2, out="runs/try"))  # every process

Every process of the job calls `run_training` with the same options (the command line writes
them to `options.json` for the processes it launches); rank 0 writes the run directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from dptrain import runtime as dd
from dptrain.data import Split
from dptrain.data.config import NO_VALIDATION, load_split, resolve_workers
from dptrain.data.loader import fetch_batch
from dptrain.data.mixing import Mixing
from dptrain.runtime import (
    Runtime,
    broadcast_object,
    distributed,
    get_rank,
    means,
    rank_zero_print,
    setup_logging,
)
from dptrain.runtime.env import SINGLE
from dptrain.runtime.job import RUN_LABEL_ENV, launcher_start_time, stamp
from dptrain.errors import AfterTrainingFailed, ConfigError, DataError
from dptrain.learners.build import (
    RunLength,
    create_learner,
    create_model,
    lr_schedule,
    model_split,
    peak_lr,
)
from dptrain.learners.config import LearnerConfig, ModelConfig, refuse_torch_options
from dptrain.learners.torch_learner import TorchLearner
from dptrain import models
from dptrain.models import DataSpec
from dptrain.models import card as run_card
from dptrain.train import init_from
from dptrain.train.faults import ENV_VAR as FAIL_AT_ENV
from dptrain.train.faults import FailAt
from dptrain.train import resume
from dptrain.options import pick
from dptrain.train.options import FitOptions, TrainOptions, as_saved, run_record
from dptrain.train.config import FROM_FIT, TrainConfig, saved_config
from dptrain.train.extras import NONE, MetricExtras
from dptrain.train.metric_names import metric_names, split_monitor
from dptrain.train.trainer import Trainer


def run_dir(options: TrainOptions, label: str) -> str:
    """`runs/<model>-<dataset>-<label>`; a dataset PATH or model file adds its file stem."""
    def name(spec: str) -> str:
        kind, sep, rest = spec.partition(":")
        if kind.endswith(".py"):  # PATH.py:FUNCTION
            return f"{Path(kind).stem}.{rest}"
        return f"{kind}-{Path(rest).stem}" if sep and Path(rest).suffix else kind

    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{name(options.model)}-{name(options.dataset)}-"
                  f"{label}").strip("-.") or "x"
    return str(Path("runs") / slug)


def agreed_run_dir(options: TrainOptions, started_at: float) -> str:
    """Rank 0's run directory, named after `started_at`, on every rank (collective)."""
    return broadcast_object(run_dir(options, stamp(started_at)) if get_rank() == 0 else None)


def load_job_split(options: TrainOptions, source: init_from.Source | None = None) -> Split:
    """The run's data; started from a language model (`source`), in its vocabulary."""
    vocabulary = source.vocabulary if source is not None else None
    sections = options.sections()
    return model_split(sections.model, load_split(sections.data, seed=sections.fit.seed,
                                                  vocabulary=vocabulary))


def resumed_options(options: TrainOptions) -> TrainOptions:
    """`options` as the run in its directory began, for a run that resumes from checkpoints
    this process can read (`as_saved`: a run from before validation parts goes on without
    one); else as they are."""
    if not options.out or options.resume == "never":
        return options
    return as_saved(options, resume.saved_record(Path(options.out) / "checkpoints"))


def preflight(options: TrainOptions) -> None:
    """Load the data and build the model once, so that bad input fails before workers start;
    an unknown --monitor too."""
    options = resumed_options(options)
    source = init_from.resolve(options.init_from) if options.init_from else None
    with silenced("dptrain.data.datasets.series"):
        # a left-out or constant series is named once, by the workers' rank 0
        split = load_job_split(options, source)
    sections = options.sections()
    model, kind = create_model(sections.model, split, seed=sections.fit.seed,
                               dataset=sections.data.dataset)
    if kind == "tagi":
        refuse_torch_options(sections.learner, options.model)
    else:  # the schedule against the run's length (warmup, milestones); mixing and the data
        lr_schedule(sections.learner, len(split.train), run_length(sections.fit))
        mixing(options, split)
    check_monitor(options, split)
    if options.init_from or options.freeze:  # a bad source or prefix, before workers start
        if source is not None:
            init_from.source_space(split, source)
        init_from.initialise(model, kind, source, sections.init)


def monitor_of(options: TrainOptions, split: Split) -> str:
    """The metric that chooses: --monitor, else the validation error or RMSE (the
    per-series-balanced val_series_nrmse for several time series; its EMA twin
    with --ema: the averaged model is the one such a run keeps); the test ones for a run from
    before validation parts (it has none), as it began."""
    if options.monitor:
        return options.monitor
    if options.val_size == NO_VALIDATION:
        return "test_error" if split.task == "classification" else "test_rmse"
    monitor = split_monitor(split, metric_extras(options, split))
    return ema_metric(monitor) if options.ema and monitor else monitor


def metric_extras(options: TrainOptions, split: Split) -> MetricExtras:
    """What the model's family adds to the Trainer's report on this data
    (`dptrain.models.metric_extras`)."""
    return models.metric_extras(options.model, DataSpec.of(split))


def mixing(options: TrainOptions, split: Split) -> Mixing | None:
    """The run's mixup/cutmix, or None; one line where the data cannot take it."""
    if not (options.mixup or options.cutmix):
        return None
    if split.task != "classification":
        raise ConfigError(f"mixup and cutmix mix class labels; dataset {options.dataset} is a "
                          f"{split.task} task")
    if options.cutmix and len(split.input_shape) != 3:
        raise ConfigError(f"cutmix pastes a box of one image into another; dataset "
                          f"{options.dataset} has inputs of shape {split.input_shape}, not "
                          f"(channels, height, width)")
    return Mixing(mixup=options.mixup, cutmix=options.cutmix, num_classes=split.num_classes,
                  seed=options.seed)


def write_model_card(options: TrainOptions, split: Split, window_scaled: bool) -> None:
    """Rank 0, before the first step: what rebuilds the model from the run alone
    (`dptrain.models.card`), with how it decodes: σ_v, the class-probability link, and
    whether a series' windows are scaled by their own mean and spread (chosen on the data
    when training starts); a resumed run keeps the card it began with."""
    if get_rank() != 0:
        return
    learner = options.part(LearnerConfig)
    run_card.write(options.out, model=options.model, config=asdict(options.part(ModelConfig)),
                   seed=options.seed, split=split,
                   decoding={"sigma_v": learner.sigma_v, "hrc_link": learner.hrc_link,
                             "window_scaling": window_scaled})


def run_length(fit: FitOptions) -> RunLength:
    """What the learning-rate schedule is laid over: the fit section's fields of that name."""
    return pick(RunLength, fit)



@contextlib.contextmanager
def silenced(name: str) -> Iterator[None]:
    """Logger `name` says nothing inside: for work whose warnings the real run gives again."""
    logger = logging.getLogger(name)
    was_disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was_disabled


def reported_metrics(options: TrainOptions, split: Split) -> list[str]:
    """The metric names a run with `options` reports each epoch (epochs.csv's columns but
    epoch and step): what the learner it builds reports, found by asking it, not by a list
    kept in step with it by hand. One training step and one evaluation on a few samples, on
    this process's CPU, with no process group, on a learner made for the purpose."""
    sections = options.sections()
    model = sections.model
    if model.precision == "fp16":  # needs CUDA; the metrics are those of float32
        model = replace(model, precision="32")
    # A probe of one step judges nothing: its collapse verdict would be about two samples.
    learner_config = replace(sections.learner, stop_on_collapse=False)
    learner = create_learner(model, learner_config, split, seed=sections.fit.seed,
                             dataset=sections.data.dataset, run=run_length(sections.fit))
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    # Two samples at least: BatchNorm needs two values per channel to train.
    with silenced("dptrain.learners.tagi_learner"):
        train = learner.train_step(
            fetch_batch(split.train, 0, torch.arange(min(2, len(split.train)))))
        tested = learner.eval_step(
            fetch_batch(split.test, 0, torch.arange(min(2, len(split.test)))))
        parts = ("val", "test") if split.validation is not None else ("test",)
        # each part as it is evaluated: the validation part reports what chooses
        evaluated = {part: learner.end_evaluation(means(tested), part) for part in parts}
    extras = metric_extras(options, split)
    names = [*metric_names(learner.end_training(means(train)), "train", extras),
             *(name for part in parts for name in metric_names(evaluated[part], part, extras))]
    return sorted(set(names))


def check_monitor(options: TrainOptions, split: Split) -> None:
    """A --monitor the run does not report is refused in one line that lists those it does;
    a test metric too (validation chooses, test reports), but for a run from before
    validation parts that monitored one."""
    if not options.monitor or options.monitor == split_monitor(split, metric_extras(options, split)):
        return
    if options.monitor.startswith("test_") and options.val_size != NO_VALIDATION:
        raise ConfigError(f"--monitor {options.monitor}: the test part is evaluated and "
                          f"reported, never used to choose the best epoch or to stop; monitor "
                          f"its validation twin, val_{options.monitor[len('test_'):]}")
    names = reported_metrics(options, split)
    if options.monitor not in names:
        raise ConfigError(f"--monitor {options.monitor!r} is not a metric of this run "
                          f"({options.model} on {options.dataset}); it reports: "
                          f"{', '.join(names)}")


def train_config(options: TrainOptions, split: Split, *, torch_model: bool = False
                 ) -> TrainConfig:
    """The Trainer's config: the fit section's fields as they are (`FROM_FIT`), with the run
    directory, the monitored metric the task implies (its EMA twin with --ema) and a torch
    model's peak learning rate in the record."""
    sections = options.sections()
    fit = sections.fit
    fail_at = fit.fail_at or os.environ.get(FAIL_AT_ENV, "")
    monitor = monitor_of(options, split)
    record = dict(vars(options))
    if torch_model:  # what --lr became at this global batch (--lr-scaling)
        record["peak_lr"] = peak_lr(sections.learner, fit.batch_size)
    return TrainConfig(
        **{name: getattr(fit, name) for name in FROM_FIT}, out_dir=Path(fit.out),
        monitor=monitor, monitor_mode="max" if "log_likelihood" in monitor else "min",
        fail_at=FailAt.parse(fail_at) if fail_at else None, record=record,
        mixing=mixing(options, split) if torch_model else None,
        run_record=run_record(options),
        workers=resolve_workers(sections.data, split, torch.get_num_threads()))


def run_training(options: TrainOptions, *, preflown: bool = False) -> dict[str, Any]:
    """Join the job's process group, train, and return the summary (every process).
    `preflown`: the launcher ran `preflight` (dptrain train's own workers); else an unknown
    --monitor is refused here, before the process group starts."""
    if options.monitor and not preflown:
        check_monitor(resumed_options(options), load_job_split(resumed_options(options)))
    with distributed(timeout=timedelta(seconds=options.timeout)) as runtime:
        if not options.out and os.environ.get(RUN_LABEL_ENV):
            # A multi-node `dptrain train` without --out: its agents agreed on the label.
            options = replace(options, out=run_dir(options, os.environ[RUN_LABEL_ENV]))
        elif not options.out:
            # A launcher that names no job: rank 0 decides. Under torchrun its agent's start
            # time, which the restarted attempts share, so they find the directory again.
            started = launcher_start_time() if runtime.env.launcher == "torchrun" else None
            options = replace(options, out=agreed_run_dir(options, started or time.time()))
        setup_logging(runtime.env.rank)
        logging.getLogger("dptrain").setLevel(logging.WARNING)
        return run_job(options, runtime)


def run_job(options: TrainOptions, runtime: Runtime) -> dict[str, Any]:
    if options.resume == "auto":
        # A run from before validation parts resumes as it began (BEFORE_OPTION), whichever
        # node holds its checkpoints: decided before its data is split.
        options = as_saved(options, resume.any_saved_record(
            Path(options.out) / "checkpoints", runtime.env.local_rank))
    source = init_from.resolve(options.init_from) if options.init_from else None
    split = load_job_split(options, source)
    if source is not None:
        split = init_from.source_space(split, source)
    check_same_files(split)
    sections = options.sections()
    learner = create_learner(sections.model, sections.learner, split, seed=sections.fit.seed,
                             dataset=sections.data.dataset, run=run_length(sections.fit))
    config = train_config(options, split, torch_model=isinstance(learner, TorchLearner))
    if source is not None or options.freeze:
        said = init_from.initialise(*learner_model(learner), source, sections.init)
        rank_zero_print(f"dptrain train: {said}")
    if source is not None:
        config = replace(config, run_record={**config.run_record, **source.record()})
    # The device type, not rank 0's device: with NCCL every rank has its own GPU.
    rank_zero_print(f"dptrain train: {options.model} on {split!r}, {runtime.env.world_size} "
                    f"process(es) ({runtime.env.launcher}, {runtime.backend or 'no group'}) "
                    f"on {runtime.device.type}, global batch {options.batch_size}, run "
                    f"directory {options.out}")
    if "peak_lr" in config.record:
        rank_zero_print(f"learning rate: {optimizer_line(options, config.record['peak_lr'])}")
    if (counted := learner.flops_per_token()) is not None:
        model, _ = learner_model(learner)
        params = sum(p.numel() for p in model.parameters())
        rank_zero_print(f"model: {params / 1e6:.2f} M parameters, {counted[0] / 1e6:.2f} MFLOP "
                        f"per token to train (forward and backward)")
    write_model_card(options, split, getattr(learner, "window_scaling", None) is not None)
    summary = Trainer(learner, split, config, runtime,
                      extras=metric_extras(options, split)).fit()
    if summary.get("failed_after_training"):  # the run is whole; what came after it is not
        raise AfterTrainingFailed(
            f"training ended and its checkpoints are whole in {options.out}, but after it "
            f"{summary['failed_after_training']} (summary.json: failed_after_training)")
    rank_zero_print(f"done: {headline(summary, split.task, metric_extras(options, split))} after {run_extent(summary)}, "
                    f"{chosen_by(summary)}, {summary['samples_per_s']:.0f} samples/s"
                    f"{token_rates(summary)}, {summary['wall_time_s']:.1f} s\n"
                    f"run directory: {options.out} (summary.json, epochs.csv, "
                    f"learning_curves.png, checkpoints/; TensorBoard: tensorboard --logdir "
                    f"{Path(options.out) / 'tb'})")
    return summary


def learner_model(learner: Any) -> tuple[Any, str]:
    """(model, kind) of a learner not yet set up: the network its weights live in."""
    if hasattr(learner, "module"):
        return learner.module, "torch"
    return learner.model, "tagi"


def ema_metric(name: str) -> str:
    """The EMA model's twin of a metric column: test_error -> test_ema_error."""
    part, _, metric = name.partition("_")
    return f"{part}_ema_{metric}"


def optimizer_line(options: TrainOptions, peak: float) -> str:
    """How the learning rate was set, for the job's first lines."""
    scaled = "" if options.lr_scaling == "none" else \
        f" ({options.lr:g} at batch {options.lr_batch}, {options.lr_scaling} scaling to batch " \
        f"{options.batch_size})"
    unit = "steps" if options.max_steps is not None else options.schedule_unit  # in steps
    warmup = f", warmup {options.warmup:g} {unit}" if options.warmup else ""
    return f"peak {peak:.6g}{scaled}, {options.optimizer}, schedule {options.schedule}{warmup}"


def check_same_files(split: Split) -> None:
    """Collective: every process read the same files (a node with another copy of an image
    folder would train on other samples under the same indices)."""
    seen = dd.all_gather_object(split.fingerprint)
    if len(set(seen)) > 1:
        odd = [r for r, f in enumerate(seen) if f != seen[0]]
        raise DataError(f"{split.name}: rank(s) {odd} see other files than rank 0 (a different "
                        f"copy of the dataset on their node?); every process must read the "
                        f"same files")


def run_extent(summary: dict[str, Any]) -> str:
    """How far the run went: its epochs, and its steps when it was counted in steps."""
    config = saved_config(summary.get("config", {}))
    if config.get("max_steps") or config.get("val_every"):
        return f"{summary['steps']} step(s) ({summary['epochs_done']:.3g} epochs)"
    return f"{summary['final_epoch']} epoch(s)"


def token_rates(summary: dict[str, Any]) -> str:
    """Token data: tokens per second of training and the MFU, for the final line."""
    if "tokens_per_s" not in summary:
        return ""
    mfu = f", MFU {100 * summary['mfu']:.1f} %" if summary.get("mfu") is not None else ""
    return f", {summary['tokens_per_s']:.0f} tokens/s{mfu}"


def chosen_by(summary: dict[str, Any]) -> str:
    """Which epoch best/ holds and the metric that chose it, for the final line."""
    monitor = summary.get("monitor")
    if not monitor or summary.get("best_epoch") is None:
        return "no best/ (nothing monitored)"
    counted_in_steps = saved_config(summary.get("config", {})).get("val_every")
    where = f"step {summary['best_step']}" if counted_in_steps else \
        f"epoch {summary['best_epoch']}"
    return f"best/ {where} by {monitor} {summary[f'best_{monitor}']:.4g}"


def headline(summary: dict[str, Any], task: str, extras: MetricExtras = NONE) -> str:
    """The test metric users look at first, with how calibrated the predictions are; the
    model family's figures where it leads with its own (`MetricExtras.headline`)."""
    def pct(key: str, digits: int = 1) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{100 * value:.{digits}f} %"

    led = extras.headline(summary) if extras.headline is not None else None
    if led is not None:
        return led
    if task == "classification":
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
    if summary.get("forecast_rmse") is not None:  # a time series (docs/tutorials/forecasting.md)
        naive = summary.get("forecast_nd_naive")
        versus = "" if naive is None else f" (seasonal naive {naive:.3f})"
        shown += (f"; forecast of the test part: rmse {summary['forecast_rmse']:.4g}, ND "
                  f"{summary['forecast_nd']:.3f}{versus}, MASE {summary['forecast_mase']:.3f}, "
                  f"interval coverage 1σ {pct('forecast_coverage_1sigma')} / 2σ "
                  f"{pct('forecast_coverage_2sigma')} / 3σ {pct('forecast_coverage_3sigma')}")
        if summary.get("forecast_log_likelihood") is not None:
            shown += f", log-likelihood {summary['forecast_log_likelihood']:.4g}"
        if summary.get("forecast_log_likelihood_naive") is not None:
            shown += (f" (seasonal naive {summary['forecast_log_likelihood_naive']:.4g}, 2σ "
                      f"{pct('forecast_coverage_2sigma_naive')})")
    return shown
