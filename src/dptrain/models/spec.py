"""What a model family declares: its models, the data it takes, what of it a run saves, the
blocks parallelism wraps and what it adds to the report.

A family is one module of `dptrain.models` (or of your own package) that ends with

    FAMILY = Family(name="mlp", models=(ModelSpec("tagi-mlp", "tagi", tagi_mlp, "..."), ...),
                    data=frozenset({"features", "images", "series"}), options=("hidden",))

and is registered with `dptrain.models.register(FAMILY)`. The Trainer and the learners never
ask which family a model is: they ask its spec (`get_model(name).family`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from dptrain.errors import ConfigError
from dptrain.tagi import HRCSoftmax

if TYPE_CHECKING:
    from dptrain.models.data_spec import DataSpec

Kind = Literal["tagi", "torch"]
DATA_KINDS = ("features", "images", "series", "tokens")
"""features: flat rows of a table; images: (C, H, W) or flat rows of a square image; series:
windows of a time series; tokens: windows of token ids (text:, tokens:)."""


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What a user may change about a built-in model without writing one."""

    hidden: int = 128
    """Width of the hidden layers of the MLPs."""
    dropout: float = 0.0
    """torch-mlp: dropout probability after each hidden layer (it draws from torch's global
    generator, per rank, while training)."""
    width: int = 64
    """ResNets: channels of the first stage (the stages have width, 2, 4 and 8 times width);
    64 is the usual ResNet18, smaller values make tiny networks for tests."""
    gain_weight: float | None = None
    """TAGI: scale of the initial weight standard deviations (None: the model's default)."""
    gain_bias: float | None = None
    """TAGI: the same for biases (None: as gain_weight)."""
    dtype: torch.dtype = torch.float32
    """TAGI: float32 or float64."""
    heteroscedastic: bool = False
    """TAGI regression (tagi-mlp, tagi-lstm): 2 outputs per target, (mean, noise) pairs through
    EvenExp."""
    series_embedding: int = 0
    """tagi-lstm: width of an Embedding of the series id, which then follows each window's
    values in the input (0: no id)."""
    num_series: int = 0
    """tagi-lstm with series_embedding: how many series (rows of the embedding table)."""
    num_features: int = 1
    """tagi-lstm on flat windows: values per time step (a series' value and its known
    covariates), so that a flat input of L · num_features values is L steps."""
    layers: int = 4
    """torch-gpt, tagi-gpt: transformer blocks."""
    heads: int = 4
    """torch-gpt, tagi-gpt: attention heads per block (width must be a multiple)."""
    vocab_size: int = 0
    """tagi-gpt: the tokens of the vocabulary (rows of its embedding; its output width is the
    hierarchical softmax's for that many classes)."""


@dataclass(frozen=True)
class MetricExtras:
    """What a model family adds to the Trainer's generic report."""

    derive: Callable[[dict[str, float], str], dict[str, float]] | None = None
    """Figures the family derives from a part's mean metrics, named with the part's prefix (a
    language model's `{part}_perplexity` and `{part}_bits_per_{unit}` from its loss in nats
    per position); None: none."""
    headline: Callable[[dict[str, Any]], str | None] | None = None
    """The figures the final line leads with, from summary.json's values (None, or a None
    result: the task's, test error or RMSE)."""
    positions_per_sample: int | None = None
    """Predictions per sample (a language model's positions per window): the positions seen
    (steps.csv's `tokens`, summary.json's `tokens_seen`), positions per second of training
    (`tokens_per_s`, also on the progress bar) and, for a model that declares its FLOPs per
    position (`Learner.flops_per_token`), the MFU. None: none of these."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Extra summary.json entries, as they are (e.g. the vocabulary's kind and size, the
    unknown characters met in each part)."""
    monitor: str | None = None
    """The family's default metric that chooses, without its part's prefix ("loss": val_loss),
    where the task's default (val_error, val_rmse) does not fit; None: the task's."""

    def __post_init__(self) -> None:
        if self.positions_per_sample is not None and self.positions_per_sample < 1:
            raise ConfigError(f"positions_per_sample must be >= 1 (or None), got "
                              f"{self.positions_per_sample}")
        if self.monitor is not None and self.monitor.startswith(("train_", "val_", "test_")):
            raise ConfigError(f"MetricExtras.monitor names a metric without its part "
                              f"(loss, not val_loss), got {self.monitor!r}")



@dataclass(frozen=True)
class ModelSpec:
    """One model of a family: a name `--model` takes, its learner kind and builder."""

    name: str
    kind: Kind
    build: Callable[[tuple[int, ...], int, ModelOptions], Any]
    summary: str
    defaults: dict[str, Any] = field(default_factory=dict)
    """Training defaults this model was tuned with (batch_size, sigma_v, gain, ...), used where
    the user gave no value."""
    options: tuple[str, ...] | None = None
    """The `ModelOptions` its builder reads, where they differ from its family's."""
    family: Family | None = field(default=None, compare=False, repr=False)
    """Set when its family is registered."""

    @property
    def option_names(self) -> tuple[str, ...]:
        """The `ModelOptions` this model's builder reads: the sizes a run saves."""
        if self.options is not None:
            return self.options
        return self.family.options if self.family is not None else ()

    @property
    def takes_tokens(self) -> bool:
        """A language model: windows of token ids in, the next token at every position out."""
        return self.family is not None and self.family.data == frozenset({"tokens"})


@dataclass(frozen=True)
class Family:
    """A model family: its models and everything the rest of dptrain asks about them."""

    name: str
    models: tuple[ModelSpec, ...]
    data: frozenset[str]
    """The data kinds (`DATA_KINDS`) its models take; others are refused in one line."""
    options: tuple[str, ...] = ()
    """The `ModelOptions` its builders read: the sizes a run saves as the model's
    configuration (beside the data's shape, vocabulary and normalisation)."""
    check_input: Callable[[ModelSpec, tuple[int, ...]], None] | None = None
    """Raises a one-line ConfigError where a model cannot take samples of a shape."""
    check_options: Callable[[ModelSpec, ModelOptions], None] | None = None
    """Raises a one-line ConfigError where the options do not make a model (before any data
    is read)."""
    blocks: Callable[[Any], list[torch.nn.Module]] | None = None
    """A torch model's blocks, the units activation checkpointing and FSDP wrap one by one;
    None: the model's own `shard_units()` if it has one, else the whole model."""
    metrics: Callable[[DataSpec], MetricExtras] | None = None
    """What the family adds to the report for the data it trains on."""

    def extras(self, data: DataSpec) -> MetricExtras:
        return self.metrics(data) if self.metrics is not None else MetricExtras()


def num_outputs(kind: Kind, task: str, num_classes: int | None, num_targets: int | None
                ) -> int:
    """The output width a learner of `kind` needs: the hierarchical-softmax width for TAGI
    classification (11 for 10 classes), the number of classes for torch classification, the
    number of targets for regression."""
    if task != "classification":
        return int(num_targets)
    if kind == "tagi":
        return HRCSoftmax(num_classes).num_outputs
    return int(num_classes)

