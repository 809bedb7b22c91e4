"""The learner factory: a model and a learner for a dataset, with every policy decided here.

    from dptrain.data import load_dataset
    from dptrain.learners.build import create_learner
    from dptrain.learners.config import LearnerConfig, ModelConfig

    split = load_dataset("digits")
    learner = create_learner(ModelConfig(model="torch-cnn"), LearnerConfig(lr=1e-3), split,
                             seed=0)                  # a TorchLearner, not yet set up

The policies, keyed on what the model is (its kind, "tagi" or "torch", known from the registry
or, for a model file, from what its function returns): which options each kind takes (precision,
heteroscedastic), the loss per task (with label smoothing), the optimiser with its weight-decay
groups, the learning-rate schedule over the run's optimizer steps, the EMA of the weights, and
global-batch BatchNorm for torch models that have BatchNorm. The command line, `dptrain.load_run` and library users all come
through here, so a run built by hand trains exactly as `dptrain train` would.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from dptrain.data import Split, steps_per_epoch
from dptrain.data.datasets.registry import SERIES_DATASETS
from dptrain.data.datasets.series import with_series_ids
from dptrain.errors import ConfigError
from dptrain.learners.config import (
    LearnerConfig,
    ModelConfig,
    betas as learner_betas,
    milestones,
    refuse_torch_options,
)
from dptrain.models import DataSpec, Kind, ModelOptions, ModelSpec, build_model
from dptrain.models import MODELS, check_input, family_blocks, get_model, num_outputs
from dptrain.models.data_spec import input_dtype
from dptrain.learners.optim import OptimizerSpec
from dptrain.learners.parallelize import model_blocks
from dptrain.learners.schedule import LrSchedule, scaled_lr
from dptrain.learners.tagi_learner import TagiLearner
from dptrain.learners.targets import per_position_targets
from dptrain.learners.torch_config import OptimizerFactory
from dptrain.learners.torch_learner import TorchLearner
from dptrain.learners.window_scaling import WindowScaling
from dptrain.learners.window_scaling import choose as choose_window_scaling
from dptrain.models.user_file import is_model_file, load_user_model
from dptrain.tagi import manual_seed

SERIES_OPTIONS = frozenset({"lookback", "horizon", "test_size", "season", "forecast_every",
                            "time_features", "covariates"})
"""Options only a time series takes (data/config.py refuses them for other data)."""


def model_defaults(name: str, dataset: str | None = None) -> dict[str, Any]:
    """The training options a built-in model was tuned with (batch size, σ_v, gain, ...), to
    use where the user set none; {} for any other name (a model file). With `dataset` that
    is not a time series, without the series options (which that data would refuse)."""
    defaults = dict(MODELS[name].defaults) if name in MODELS else {}
    if dataset is not None and dataset.partition(":")[0] not in SERIES_DATASETS:
        defaults = {k: v for k, v in defaults.items() if k not in SERIES_OPTIONS}
    return defaults


def model_split(config: ModelConfig, split: Split) -> Split:
    """The split as the model reads it: for a series embedding, windows followed by their
    series' id (`with_series_ids`); else `split` itself."""
    return with_series_ids(split) if config.series_embedding else split


def create_model(config: ModelConfig, data: DataSpec | Split, *, seed: int,
                 dataset: str | None = None) -> tuple[Any, Kind]:
    """(model, kind) sized for `data` (a split, or the `DataSpec` a run kept of it),
    initialised from `seed` (the same on every rank).

    Every mismatch between model, options and data is a one-line ConfigError; `dataset` is the
    data's name in those lines (default: the data's own).
    """
    data = data if isinstance(data, DataSpec) else DataSpec.of(data)
    dataset = dataset or data.name
    if config.heteroscedastic and data.task == "classification":
        raise ConfigError(f"--heteroscedastic is for regression; dataset {dataset} is a "
                          f"classification task")
    if is_model_file(config.model):
        model, kind = _user_model(config, data, seed)
    else:
        spec = get_model(config.model)
        _check_heteroscedastic(config, spec)
        _check_data(spec, data, dataset)
        torch.manual_seed(seed)
        manual_seed(seed)
        width = num_outputs(spec.kind, data.task, data.num_classes, data.num_targets)
        model, kind = build_model(config.model, data.input_shape, width,
                                  _sized_options(config, data, dataset)), spec.kind
    _check_kind_options(config, kind)
    return model, kind


def _user_model(config: ModelConfig, data: DataSpec, seed: int) -> tuple[Any, Kind]:
    built = load_user_model(config.model, data.input_shape, task=data.task,
                            input_dtype=data.input_dtype, num_classes=data.num_classes,
                            num_targets=data.num_targets, seed=seed,
                            heteroscedastic=config.heteroscedastic)
    if built.kind == "tagi" and config.precision == "64":
        built.model.to(torch.float64)
    return built.model, built.kind


def _check_heteroscedastic(config: ModelConfig, spec: ModelSpec) -> None:
    """A TAGI model is heteroscedastic where its family builds a (mean, noise) output pair
    per target; a model file may have one too."""
    if config.heteroscedastic and spec.kind == "tagi" \
            and "heteroscedastic" not in spec.option_names:
        with_pairs = [n for n, s in MODELS.items()
                      if s.kind == "tagi" and "heteroscedastic" in s.option_names]
        raise ConfigError(f"--heteroscedastic needs a (mean, noise) output pair per target: "
                          f"{', '.join(with_pairs)} or your own model file have it, "
                          f"{config.model} does not")


def _check_data(spec: ModelSpec, data: DataSpec, dataset: str) -> None:
    """Token windows go to a language model and a language model takes nothing else; then the
    family's own check of the input shape, and the data kinds it takes."""
    if spec.takes_tokens and data.vocabulary is None:
        raise ConfigError(f"dataset {dataset}: {spec.name} is a language model; it trains on "
                          f"token data (text:PATH or tokens:DIR)")
    if data.vocabulary is not None and not spec.takes_tokens:
        language_models = [n for n, s in MODELS.items() if s.takes_tokens]
        raise ConfigError(f"dataset {dataset}: windows of token ids need a language model "
                          f"(--model {' or '.join(language_models)}) or your own model file; "
                          f"{spec.name} is not one")
    try:
        check_input(spec.name, data.input_shape)
    except ConfigError as err:
        raise ConfigError(f"dataset {dataset}: {err}") from None
    if not spec.family.data & data.kinds:
        raise ConfigError(f"dataset {dataset}: model {spec.name} takes "
                          f"{' or '.join(sorted(spec.family.data))}; the dataset's inputs "
                          f"{tuple(data.input_shape)} are {' or '.join(sorted(data.kinds))}")


def _sized_options(config: ModelConfig, data: DataSpec, dataset: str) -> ModelOptions:
    """The builder's options, with the vocabulary's size, the values per time step of a series
    with covariates and the number of series of an embedded series id."""
    options = config.builder_options()
    if data.vocabulary is not None:
        options = dataclasses.replace(options, vocab_size=data.num_classes)
    if data.series is not None:
        options = dataclasses.replace(options, num_features=data.series.num_features)
    if not config.series_embedding:
        return options
    if data.series is None or not data.series.with_ids:
        raise ConfigError(f"dataset {dataset}: --series-embedding needs windows that carry "
                          f"their series id (a time series split through model_split or "
                          f"with_series_ids)")
    return dataclasses.replace(options, num_series=len(data.series.names))


def _check_kind_options(config: ModelConfig, kind: Kind) -> None:
    """A model file's kind is only known once built: the per-kind rules again, for it."""
    if kind == "tagi" and config.precision not in ("32", "64"):
        raise ConfigError(f"precision {config.precision} is for torch models; {config.model} "
                          f"is a TAGI model (32 or 64)")
    if kind == "torch" and (config.precision == "64" or config.heteroscedastic):
        raise ConfigError(f"{config.model} is a torch model: precision 64 and "
                          f"--heteroscedastic are for TAGI models")


@dataclasses.dataclass(frozen=True)
class RunLength:
    """What a learning-rate schedule is laid over: the global batch and the epochs, or the
    steps of a run counted in steps (then warmup, lr-step-size and milestones count steps).
    Its fields are `dptrain.train.options.FitOptions`' of the same names."""

    batch_size: int
    epochs: int
    max_steps: int | None = None
    """The run's length in global steps (--max-steps), which then replaces epochs."""
    lr_decay_steps: int | None = None
    """Where cosine, linear and wsd reach min-lr (--lr-decay-steps); None: max_steps."""


def create_learner(model_config: ModelConfig, learner_config: LearnerConfig, split: Split, *,
                   seed: int, dataset: str | None = None, run: RunLength | None = None
                   ) -> TagiLearner | TorchLearner:
    """The learner for `split`: TAGI's for a TAGI network, the torch learner for a module.
    `run`: the global batch and epochs, which a schedule, a warmup or lr scaling need."""
    model, kind = create_model(model_config, split, seed=seed, dataset=dataset)
    if kind == "tagi":
        refuse_torch_options(learner_config, model_config.model)
        return tagi_learner(model, learner_config, split, model_config.heteroscedastic,
                            window_scaling(model_config, split, dataset or split.name))
    if model_config.window_scaling == "on":
        raise ConfigError(f"window-scaling on is for TAGI models, whose forecasts it scales; "
                          f"{model_config.model} is a torch model")
    _refuse_missing_targets(split, model_config.model, dataset or split.name)
    blocks = family_blocks(model_config.model, model) or model_blocks(model)
    if learner_config.activation_checkpointing and not blocks:
        raise ConfigError(f"--activation-checkpointing: recomputes a model's blocks; "
                          f"{model_config.model} has none (torch-gpt has; a model family "
                          f"declares them, a module of your own with shard_units())")
    if (learner_config.mixup or learner_config.cutmix) \
            and not input_dtype(split).is_floating_point:
        raise ConfigError(f"dataset {dataset or split.name}: --mixup and --cutmix blend "
                          f"inputs, and its inputs are integer ids (tokens), which cannot be "
                          f"blended")
    schedule = lr_schedule(learner_config, len(split.train), run)
    return torch_learner(model, learner_config, split.task, model_config.precision,
                         schedule=schedule, per_position=per_position_targets(split),
                         blocks=blocks)


def _refuse_missing_targets(split: Split, model: str, dataset: str) -> None:
    """A time series may miss values, which TAGI leaves out of its update; a torch loss would
    turn them into NaN gradients."""
    targets = getattr(split.train, "y", None)
    if split.series is None or targets is None:
        return
    missing = int(torch.isnan(targets).sum())
    if missing:
        raise ConfigError(f"dataset {dataset}: {missing} training target(s) are missing values; "
                          f"{model} is a torch model, whose loss cannot leave them out: use a "
                          f"TAGI model (tagi-mlp, tagi-lstm), which skips them")


def window_scaling(config: ModelConfig, split: Split, dataset: str) -> WindowScaling | None:
    """Where a TAGI model's windows are scaled by their own mean and spread
    (`dptrain.learners.window_scaling.choose`)."""
    if config.window_scaling == "on" and split.series is None:
        raise ConfigError(f"dataset {dataset}: window-scaling on scales the windows of a time "
                          f"series, and this dataset is not one")
    if split.series is None:
        return None
    return choose_window_scaling(split.series, config.window_scaling, dataset)


def tagi_learner(model: Any, config: LearnerConfig, split: Split,
                 heteroscedastic: bool = False, scaling: WindowScaling | None = None
                 ) -> TagiLearner:
    """A TAGI network's learner: σ_v schedule, data-parallel mode, metrics in data units, and
    per position for the split's targets that are one class per position (token data)."""
    y_scale = split.y_norm.std if split.y_norm is not None else None
    return TagiLearner(model, task=split.task, num_classes=split.num_classes,
                       sigma_v=config.sigma_v, sigma_v_min=config.sigma_v_min,
                       sigma_v_decay=config.sigma_v_decay, average=config.average,
                       y_scale=y_scale, heteroscedastic=heteroscedastic,
                       stop_on_collapse=config.stop_on_collapse, hrc_link=config.hrc_link,
                       compile={"on": True, "off": False}.get(config.compile, "auto"),
                       window_scaling=scaling, per_position=per_position_targets(split))


def torch_learner(model: nn.Module, config: LearnerConfig, task: str,
                  precision: str = "32", *, schedule: LrSchedule | None = None,
                  per_position: bool = False, blocks: list[nn.Module] | None = None
                  ) -> TorchLearner:
    """A torch module's learner: the task's loss, the optimizer with its decay groups, the
    schedule, and BatchNorm over the global batch when the model has BatchNorm (each rank's
    share alone would be a smaller batch than the one the model is trained for).
    `per_position`: the targets are one class per position of the input window (token
    data: `dptrain.learners.targets.per_position_targets`); `blocks`: the model's blocks, which
    activation checkpointing and FSDP wrap (None: the model's own `shard_units()`)."""
    if config.label_smoothing and task != "classification":
        raise ConfigError(f"label-smoothing is for classification; this dataset is a {task} "
                          f"task")
    optimizer = OptimizerSpec(name=config.optimizer,
                              lr=schedule.peak if schedule is not None else config.lr,
                              momentum=config.momentum, nesterov=config.nesterov,
                              betas=learner_betas(config), weight_decay=config.weight_decay,
                              decay_norm_and_bias=config.decay_norm_and_bias)
    return TorchLearner(model, task_loss(task, config.label_smoothing), optimizer,
                        precision=precision, strategy=config.strategy,
                        accumulation_steps=config.accumulation_steps,
                        sync_batchnorm=has_batchnorm(model),
                        max_grad_norm=config.clip_grad_norm or None, lr_schedule=schedule,
                        ema_decay=config.ema, ema_every=config.ema_every,
                        compile=config.compile == "on", per_position=per_position,
                        activation_checkpointing=config.activation_checkpointing,
                        blocks=blocks)


def peak_lr(config: LearnerConfig, batch_size: int) -> float:
    """The learning rate the schedule peaks at: lr scaled from lr-batch to `batch_size`."""
    return scaled_lr(config.lr, batch_size, config.lr_batch, config.lr_scaling)


def lr_schedule(config: LearnerConfig, num_train: int, run: RunLength | None
                ) -> LrSchedule | None:
    """The run's schedule over its optimizer steps; None when the rate stays `lr` throughout
    (the optimizer keeps the rate it was built with, as before schedules existed). Every
    inconsistency with the run's length is a one-line ConfigError."""
    fixed = config.schedule == "constant" and not config.warmup and config.lr_scaling == "none"
    if fixed:
        return None
    if run is None:
        raise ConfigError("a learning-rate schedule, warmup or lr scaling needs the run's "
                          "global batch and epochs (create_learner(..., run=RunLength(...)))")
    # The sampler's count of global batches, the same on any world size (one process taking
    # the whole global batch).
    per_epoch = steps_per_epoch(num_train, 1, run.batch_size)
    total = per_epoch * run.epochs if run.max_steps is None else run.max_steps
    # A run counted in steps counts its schedule in steps (nanoGPT's warmup_iters).
    unit = config.schedule_unit if run.max_steps is None else "steps"
    length = f"{run.epochs} epochs of {per_epoch} steps = {total} steps" \
        if run.max_steps is None else f"max-steps {total}"

    def steps(value: float) -> int:
        return round(value * per_epoch) if unit == "epochs" else round(value)

    if config.warmup and steps(config.warmup) >= total:
        raise ConfigError(f"warmup {config.warmup:g} {unit} is as long as the run or longer "
                          f"({length})")
    marks = milestones(config)
    if marks and steps(marks[-1]) >= total:
        raise ConfigError(f"milestones: {marks[-1]:g} {unit} is at or past the end of the run "
                          f"({length})")
    return LrSchedule(peak=peak_lr(config, run.batch_size), total_steps=total,
                      kind=config.schedule, warmup_steps=steps(config.warmup),
                      warmup_start=config.warmup_start, min_lr=config.min_lr,
                      step_size=steps(config.lr_step_size) if config.schedule == "step" else 0,
                      milestones=tuple(steps(m) for m in marks), decay=config.lr_decay,
                      wsd_decay=config.wsd_decay,
                      decay_steps=run.lr_decay_steps if run.max_steps is not None else None)


def task_loss(task: str, label_smoothing: float = 0.0) -> nn.Module:
    """Cross-entropy on class labels (with label smoothing ε: against (1 - ε) one-hot + ε / K),
    mean squared error on regression targets."""
    if task == "classification":
        return nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    return nn.MSELoss()


def adam(lr: float) -> OptimizerFactory:
    return functools.partial(torch.optim.Adam, lr=lr)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
