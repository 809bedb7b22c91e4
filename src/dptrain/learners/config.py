"""What a run's model and learner are: `ModelConfig` and `LearnerConfig`, each validated once.

    from dptrain.learners.config import LearnerConfig, ModelConfig

    model = ModelConfig(model="tagi-cnn", precision="64")
    learner = LearnerConfig(sigma_v=0.1, sigma_v_decay=0.95)

`dptrain.learners.build` turns them into a learner for a dataset; the command line's flags and
TOML keys are these fields (docs/design.md, Options).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from dptrain.errors import ConfigError
from dptrain.models import ModelOptions, check_model_options, kind_of, model_names
from dptrain.learners.optim import check_optimizer
from dptrain.learners.schedule import LR_SCALINGS, SCHEDULES
from dptrain.learners.tagi_learner import check_sigma_v_schedule
from dptrain.models.user_file import is_model_file
from dptrain.options import bad_value, check_at_least, cli, flag, resumable

PRECISIONS = ("32", "64", "bf16", "fp16")
DEFAULT_BETAS = "0.9,0.999"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The network: which one, its sizes, its initialisation and its number format."""

    model: str = "tagi-mlp"
    """tagi-mlp, tagi-cnn, tagi-cnn-pytagi (pytagi's initialisation), tagi-resnet18,
    tagi-lstm (time series), torch-mlp, torch-cnn, torch-resnet18, torch-resnet50 (the ResNets
    take ImageNet's stem on images of 128 pixels and more), torch-gpt and tagi-gpt (language
    models on text:PATH or tokens:DIR), or PATH.py:FUNCTION:
    FUNCTION(input_shape, num_outputs) returns a dptrain.tagi.Sequential or a torch.nn.Module."""
    precision: str = "32"
    """TAGI: 32 or 64 (float64); torch: 32, bf16, fp16 (CUDA)."""
    hidden: int = 128
    """Width of the hidden layers of the MLPs."""
    width: int = 64
    """Channels of the first ResNet stage (64: ResNet18; small for quick tests); torch-gpt:
    the embedding width (its default: 128)."""
    layers: int = 4
    """torch-gpt: transformer blocks."""
    heads: int = 4
    """torch-gpt: attention heads per block; width must be a multiple of it."""
    gain: float = 0.0
    """TAGI: gain of the initial weight (and bias) standard deviations; 0: the model's default
    (1; 0.5 for tagi-cnn on images of 24 pixels and more, 0.083 for tagi-resnet18)."""
    gain_bias: float = 0.0
    """TAGI: gain of the initial bias standard deviations if different; 0: as gain."""
    dropout: float = 0.0
    """torch-mlp: dropout probability after each hidden layer; torch-gpt: on the embeddings,
    the attention weights and each residual branch (0: none)."""
    heteroscedastic: bool = False
    """TAGI regression: learn the observation noise per input (EvenExp head with a (mean,
    noise) output pair per target) instead of a fixed sigma-v."""
    series_embedding: int = 0
    """tagi-lstm on several time series: width of a learned embedding of each window's series
    id, which then enters the model with the window's values (0: no id;
    docs/tutorials/forecasting.md)."""
    window_scaling: Literal["auto", "on", "off"] = field(default="auto",
                                                         metadata=cli(choices=True))
    """TAGI models on time series: each window in units of its own mean and spread (at least
    0.1 of its series' training spread), the prediction scaled back, so that a series whose
    level or spread changes after its training part still looks like the training windows
    (docs/tutorials/forecasting.md, Window scaling): on, off, or auto (on where a series' validation
    part leaves its training range: its mean over 3 training standard deviations away, or its
    spread over 3 times the training one)."""

    def __post_init__(self) -> None:
        if kind_of(self.model) is None and not is_model_file(self.model):
            raise bad_value(self, "model", f"one of {', '.join(model_names())}, or "
                                           f"PATH.py:FUNCTION")
        if self.precision not in PRECISIONS:
            raise bad_value(self, "precision", f"one of {', '.join(PRECISIONS)}")
        if kind_of(self.model) == "tagi" and self.precision not in ("32", "64"):
            raise ConfigError(f"precision {self.precision} is for torch models; TAGI takes 32 "
                              f"or 64")
        if self.heteroscedastic and kind_of(self.model) == "torch":
            raise ConfigError(f"heteroscedastic is for TAGI models; {self.model} is a torch "
                              f"model")
        if kind_of(self.model) == "torch" and self.precision == "64":
            raise ConfigError("precision 64 is for TAGI models; torch models take 32, bf16, fp16")
        check_at_least(self, ("hidden", "width", "layers", "heads"), 1)
        check_at_least(self, ("series_embedding",), 0)
        if not 0.0 <= self.dropout < 1.0:
            raise bad_value(self, "dropout", "a probability in [0, 1)")
        if kind_of(self.model) is not None:
            check_model_options(self.model, self.builder_options())
        if self.gain < 0 or self.gain_bias < 0:
            raise ConfigError(f"gain and gain-bias must be > 0 (or 0 for the model's default), "
                              f"got {self.gain} and {self.gain_bias}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of a TAGI network's parameters and states."""
        return torch.float64 if self.precision == "64" else torch.float32

    def builder_options(self) -> ModelOptions:
        """What the registry's builders take (`dptrain.models`)."""
        return ModelOptions(hidden=self.hidden, dropout=self.dropout, width=self.width,
                            gain_weight=self.gain or None, gain_bias=self.gain_bias or None,
                            dtype=self.dtype, heteroscedastic=self.heteroscedastic,
                            series_embedding=self.series_embedding, layers=self.layers,
                            heads=self.heads)


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """How the network learns: TAGI's observation noise and data-parallel mode, or the torch
    learner's optimiser, strategy and accumulation."""

    sigma_v: float = 0.05
    """TAGI observation noise sigma-v (normalised units) of the first epoch."""
    sigma_v_min: float = 0.0
    """TAGI: sigma-v never decays below this."""
    sigma_v_decay: float = 1.0
    """TAGI: sigma-v at epoch e (from 0) is max(sigma-v-min, sigma-v * sigma-v-decay^e)."""
    average: bool = False
    """TAGI: average the deltas over the ranks (pytagi) instead of summing them (one update of
    the global batch)."""
    stop_on_collapse: bool = field(default=False, metadata=resumable())
    """TAGI: stop with exit status 7 once an evaluation finds the run collapsed (predictions
    that no longer depend on the input) instead of warning and training on."""
    hrc_link: Literal["auto", "mean", "probit"] = field(default="auto",
                                                        metadata=cli(choices=True))
    """TAGI classification: how class probabilities come from the outputs' moments: the mean
    link (calibrated on noisy labels), pytagi's probit (clean labels), or auto: after each
    epoch the one whose confidence is nearer the validation accuracy (without a validation
    part: under which that epoch's training labels were likelier; docs/tagi.md,
    Calibration)."""
    compile: Literal["auto", "on", "off"] = field(default="auto",
                                                  metadata=resumable(negative="no-compile"))
    """Each TAGI training step as one compiled call, with the same parameters as eager
    (docs/tagi.md, Compiled step): on, off, or auto (on for the networks the native step
    does, stacks of LSTM, Linear and ReLU layers (with or without the heteroscedastic head)
    such as tagi-lstm and tagi-mlp, which it takes in a second or two; off for the others,
    whose torch.compile program takes a minute). Torch models: on
    puts the training forward and backward through torch.compile; auto is off. What cannot
    be captured or compiled trains eagerly, saying why."""
    lr: float = 3e-3
    """Torch models: the peak learning rate, for a global batch of lr-batch when lr-scaling
    is linear or sqrt (the rate used is then printed at start and kept in the run's record)."""
    lr_batch: int = 256
    """Torch models: the global batch that lr is given for (lr-scaling linear or sqrt)."""
    lr_scaling: Literal["none", "linear", "sqrt"] = field(default="none",
                                                          metadata=cli(choices=True))
    """Torch models: the peak learning rate at batch-size is lr x (batch-size / lr-batch)
    (linear, Goyal et al. 2017), lr x sqrt(batch-size / lr-batch) (sqrt), or lr (none)."""
    optimizer: Literal["adam", "adamw", "sgd", "lars"] = field(default="adam",
                                                             metadata=cli(choices=True))
    """Torch models: adam, adamw (decoupled weight decay), sgd, or lars (layer-wise rates for
    large batches, You et al. 2017)."""
    momentum: float = 0.0
    """Torch models, sgd and lars: momentum (torchvision's recipes: 0.9)."""
    nesterov: bool = False
    """Torch models, sgd and lars: Nesterov momentum."""
    betas: str = DEFAULT_BETAS
    """Torch models, adam and adamw: the decay rates of the moment estimates, beta1,beta2
    (nanoGPT's small models: 0.9,0.99, as they see few tokens per step)."""
    weight_decay: float = 0.0
    """Torch models: weight decay (adamw: decoupled; others: L2 on the gradient); not on
    normalisation weights and biases unless decay-norm-and-bias."""
    decay_norm_and_bias: bool = False
    """Torch models: decay normalisation layers' weights and all biases too (torch's default;
    off: torchvision's recipes' rule)."""
    clip_grad_norm: float = 0.0
    """Torch models: clip the global gradient norm to this before each step (0: no clipping);
    the pre-clip norm is reported as train_grad_norm."""
    schedule: Literal["constant", "step", "multistep", "cosine", "linear", "wsd"] = field(
        default="constant", metadata=cli(choices=True))
    """Torch models: the learning rate after warmup, a function of the global optimizer step:
    constant; step (x lr-decay every lr-step-size); multistep (x lr-decay at each milestone);
    cosine or linear (to min-lr at the end); wsd (warmup-stable-decay: constant, then linear to
    min-lr over the last wsd-decay share)."""
    schedule_unit: Literal["epochs", "steps"] = field(default="epochs",
                                                      metadata=cli(choices=True))
    """Torch models: the unit of warmup, lr-step-size and milestones (epochs may be
    fractional; they count in optimizer steps of the global batch)."""
    warmup: float = 0.0
    """Torch models: linear warmup length (schedule-unit), from warmup-start x the peak."""
    warmup_start: float = 0.01
    """Torch models: the warmup's first learning rate as a fraction of the peak."""
    min_lr: float = 0.0
    """Torch models: where cosine, linear and wsd end (an absolute learning rate)."""
    lr_step_size: float = 30.0
    """Torch models, schedule step: decay every this many (schedule-unit)."""
    lr_decay: float = 0.1
    """Torch models, schedule step and multistep: the factor of each decay."""
    milestones: str = ""
    """Torch models, schedule multistep: where the rate decays, increasing, comma-separated
    (schedule-unit; e.g. 30,60,80)."""
    wsd_decay: float = 0.2
    """Torch models, schedule wsd: the share of the steps after warmup spent decaying."""
    label_smoothing: float = 0.0
    """Torch classification: cross-entropy against (1 - e) x one-hot + e / classes."""
    ema: float = 0.0
    """Torch models: keep an exponential moving average of the weights with this decay per
    update (0: none; torchvision's ResNet-50 recipe in these terms: 0.99891 every 32 steps);
    evaluated beside the live model (test_ema_* columns), checkpointed, and the model that
    monitor, best/ and load_run use."""
    ema_every: int = 1
    """Torch models: update the EMA every this many optimizer steps."""
    mixup: float = 0.0
    """Torch classification: mixup with weights ~ Beta(alpha, alpha), alpha this (0: off;
    torchvision's ResNet-50 recipe: 0.2); each sample's partner from the same global batch."""
    cutmix: float = 0.0
    """Torch classification on images: cutmix with Beta(alpha, alpha), alpha this (0: off;
    torchvision's: 1.0); with mixup too, each sample takes one of the two, half each."""
    strategy: Literal["ddp", "fsdp"] = field(default="ddp", metadata=cli(choices=True))
    """Torch models: ddp (replicated) or fsdp (FSDP2 fully_shard, sharded checkpoints)."""
    accumulation_steps: int = 1
    """Torch models: micro-batches per optimiser step (one all-reduce per step)."""
    activation_checkpointing: bool = field(default=False, metadata=resumable())
    """Models with blocks (torch-gpt): keep no activations inside each block in the forward
    and recompute them in the backward (torch.utils.checkpoint, non-reentrant): less memory
    for about a third more compute, the same gradients."""

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise bad_value(self, "strategy", "ddp or fsdp")
        if self.hrc_link not in ("auto", "mean", "probit"):
            raise bad_value(self, "hrc_link", "auto, mean or probit")
        if self.compile not in ("auto", "on", "off"):
            raise bad_value(self, "compile", "on, off or auto")
        check_at_least(self, ("accumulation_steps",), 1)
        check_sigma_v_schedule(self.sigma_v, self.sigma_v_min, self.sigma_v_decay)
        if not self.lr > 0:
            raise bad_value(self, "lr", "a learning rate > 0")
        check_torch_options(self)


TORCH_ONLY = ("lr_scaling", "optimizer", "momentum", "nesterov", "betas", "weight_decay",
              "decay_norm_and_bias", "clip_grad_norm", "schedule", "warmup", "min_lr",
              "milestones", "label_smoothing", "ema", "mixup", "cutmix",
              "activation_checkpointing")
"""Learner options a TAGI model has no use for (it has no learning rate); given one, a TAGI
run is refused rather than trained without it."""


def check_torch_options(config: LearnerConfig) -> None:
    """The torch options that need no data to check, one line each."""
    check_optimizer(config.optimizer, config.momentum, config.nesterov, config.weight_decay)
    betas(config)
    if config.lr_scaling not in LR_SCALINGS:
        raise bad_value(config, "lr_scaling", ", ".join(LR_SCALINGS))
    if config.schedule not in SCHEDULES:
        raise bad_value(config, "schedule", ", ".join(SCHEDULES))
    if config.schedule_unit not in ("epochs", "steps"):
        raise bad_value(config, "schedule_unit", "epochs or steps")
    check_at_least(config, ("lr_batch", "ema_every"), 1)
    for name in ("warmup", "min_lr", "clip_grad_norm"):
        if not getattr(config, name) >= 0:
            raise bad_value(config, name, "a value >= 0")
    if not 0.0 <= config.label_smoothing < 1.0:
        raise bad_value(config, "label_smoothing", "a value in [0, 1)")
    if not 0.0 <= config.ema < 1.0:
        raise bad_value(config, "ema", "a decay in [0, 1) (0: no EMA)")
    for name in ("mixup", "cutmix"):
        if not getattr(config, name) >= 0:
            raise bad_value(config, name, "an alpha >= 0 (0: off)")
    milestones(config)


def betas(config: LearnerConfig) -> tuple[float, float]:
    """The betas as two numbers in [0, 1); one line if they are not."""
    try:
        first, second = (float(b) for b in config.betas.split(","))
    except ValueError:
        raise bad_value(config, "betas", "two numbers in [0, 1), e.g. 0.9,0.99") from None
    if not (0.0 <= first < 1.0 and 0.0 <= second < 1.0):
        raise bad_value(config, "betas", "two numbers in [0, 1), e.g. 0.9,0.99")
    if config.betas != DEFAULT_BETAS and config.optimizer not in ("adam", "adamw"):
        raise ConfigError(f"betas are for optimizer adam or adamw; {config.optimizer} has "
                          f"none (its momentum is --momentum)")
    return first, second


def milestones(config: LearnerConfig) -> tuple[float, ...]:
    """The milestones as numbers (schedule-unit); one line if they do not parse."""
    if not config.milestones.strip():
        return ()
    try:
        return tuple(float(m) for m in config.milestones.split(","))
    except ValueError:
        raise bad_value(config, "milestones", "comma-separated numbers, e.g. 30,60,80") \
            from None


def refuse_torch_options(config: LearnerConfig, model: str) -> None:
    """A TAGI model given a gradient learner's option: one line naming its own knobs."""
    given = [f"--{flag(name)}" for name in TORCH_ONLY
             if getattr(config, name) != getattr(DEFAULT_LEARNER, name)]
    if given:
        raise ConfigError(f"{', '.join(given)}: for torch models; {model} is a TAGI model, "
                          f"which has no learning rate or optimizer: its update is set by "
                          f"--sigma-v, --sigma-v-min and --sigma-v-decay")


DEFAULT_LEARNER = LearnerConfig()
