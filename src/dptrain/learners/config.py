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
from dptrain.learners.models import MODELS, TAGI_MODELS, TORCH_MODELS, ModelOptions
from dptrain.learners.tagi_learner import check_sigma_v_schedule
from dptrain.learners.user_model import is_model_file
from dptrain.options import bad_value, check_at_least, cli, resumable

PRECISIONS = ("32", "64", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The network: which one, its sizes, its initialisation and its number format."""

    model: str = "tagi-mlp"
    """tagi-mlp, tagi-cnn, tagi-cnn-pytagi (pytagi's initialisation), tagi-resnet18,
    tagi-lstm (time series), torch-mlp, torch-cnn, torch-resnet18, torch-resnet50 (the ResNets
    take ImageNet's stem on images of 128 pixels and more), or PATH.py:FUNCTION:
    FUNCTION(input_shape, num_outputs) returns a dptrain.tagi.Sequential or a torch.nn.Module."""
    precision: str = "32"
    """TAGI: 32 or 64 (float64); torch: 32, bf16, fp16 (CUDA)."""
    hidden: int = 128
    """Width of the hidden layers of the MLPs."""
    width: int = 64
    """Channels of the first ResNet stage (64: ResNet18; small for quick tests)."""
    gain: float = 0.0
    """TAGI: gain of the initial weight (and bias) standard deviations; 0: the model's default
    (1; 0.5 for tagi-cnn on images of 24 pixels and more, 0.083 for tagi-resnet18)."""
    gain_bias: float = 0.0
    """TAGI: gain of the initial bias standard deviations if different; 0: as gain."""
    dropout: float = 0.0
    """torch-mlp: dropout probability after each hidden layer (0: none)."""
    heteroscedastic: bool = False
    """TAGI regression: learn the observation noise per input (EvenExp head with a (mean,
    noise) output pair per target) instead of a fixed sigma-v."""
    series_embedding: int = 0
    """tagi-lstm on several time series: width of a learned embedding of each window's series
    id, which then enters the model with the window's values (0: no id; docs/forecasting.md)."""

    def __post_init__(self) -> None:
        if self.model not in MODELS and not is_model_file(self.model):
            raise bad_value(self, "model", f"one of {', '.join(MODELS)}, or PATH.py:FUNCTION")
        if self.precision not in PRECISIONS:
            raise bad_value(self, "precision", f"one of {', '.join(PRECISIONS)}")
        if self.model in TAGI_MODELS and self.precision not in ("32", "64"):
            raise ConfigError(f"precision {self.precision} is for torch models; TAGI takes 32 "
                              f"or 64")
        if self.heteroscedastic and self.model in TORCH_MODELS:
            raise ConfigError(f"heteroscedastic is for TAGI models; {self.model} is a torch "
                              f"model")
        if self.model in TORCH_MODELS and self.precision == "64":
            raise ConfigError("precision 64 is for TAGI models; torch models take 32, bf16, fp16")
        check_at_least(self, ("hidden", "width"), 1)
        check_at_least(self, ("series_embedding",), 0)
        if self.series_embedding and self.model != "tagi-lstm":
            raise ConfigError(f"series-embedding is for the tagi-lstm model, not {self.model}")
        if not 0.0 <= self.dropout < 1.0:
            raise bad_value(self, "dropout", "a probability in [0, 1)")
        if self.dropout and self.model != "torch-mlp":
            raise ConfigError(f"dropout is for the torch-mlp model, not {self.model}")
        if self.gain < 0 or self.gain_bias < 0:
            raise ConfigError(f"gain and gain-bias must be > 0 (or 0 for the model's default), "
                              f"got {self.gain} and {self.gain_bias}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of a TAGI network's parameters and states."""
        return torch.float64 if self.precision == "64" else torch.float32

    def builder_options(self) -> ModelOptions:
        """What the registry's builders take (`dptrain.learners.models`)."""
        return ModelOptions(hidden=self.hidden, dropout=self.dropout, width=self.width,
                            gain_weight=self.gain or None, gain_bias=self.gain_bias or None,
                            dtype=self.dtype, heteroscedastic=self.heteroscedastic,
                            series_embedding=self.series_embedding)


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
    lr: float = 3e-3
    """Learning rate of the torch models' optimiser (Adam)."""
    strategy: Literal["ddp", "fsdp"] = field(default="ddp", metadata=cli(choices=True))
    """Torch models: ddp (replicated) or fsdp (FSDP2 fully_shard, sharded checkpoints)."""
    accumulation_steps: int = 1
    """Torch models: micro-batches per optimiser step (one all-reduce per step)."""

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise bad_value(self, "strategy", "ddp or fsdp")
        if self.hrc_link not in ("auto", "mean", "probit"):
            raise bad_value(self, "hrc_link", "auto, mean or probit")
        check_at_least(self, ("accumulation_steps",), 1)
        check_sigma_v_schedule(self.sigma_v, self.sigma_v_min, self.sigma_v_decay)
        if self.lr <= 0:
            raise bad_value(self, "lr", "a learning rate > 0")
