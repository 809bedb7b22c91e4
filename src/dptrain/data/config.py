"""`DataConfig`: which dataset a run trains on and how its training images are augmented.

    from dptrain.data.config import DataConfig, load_split

    split = load_split(DataConfig(dataset="cifar10:~/data/cifar", augment="auto"), seed=0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from dptrain.data.datasets import ArrayDataset, Split, load_dataset
from dptrain.data.datasets.covariates import parse_feature_list, time_features, with_covariates
from dptrain.data.datasets.holdout import hold_out
from dptrain.data.datasets.registry import SERIES_DATASETS, TOKEN_DATASETS
from dptrain.data.datasets.text import TOKENIZERS
from dptrain.data.datasets.token_windows import TokenWindows
from dptrain.data.datasets.sizes import DEFAULT_VAL_FRACTION, parse_size
from dptrain.data.datasets.image_folder import ImageFolderDataset
from dptrain.data.datasets.images import ImageDataset
from dptrain.errors import ConfigError
from dptrain.options import bad_value, check_at_least, cli, flag, resumable


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The data of a run."""

    dataset: str = "digits"
    """digits, digits-image, diabetes, toy1d, toy1d-hetero, blobs (3 overlapping classes),
    mnist:DIR, fashion-mnist:DIR,
    cifar10:DIR, imagefolder:DIR (DIR/train/<class>/*.png|jpg, DIR/val/...), csv:PATH,
    npz:PATH, time series: sine, seasonal, hourly, series:PATH.csv (docs/tutorials/forecasting.md),
    token windows for language models: text:PATH (a UTF-8 file, or a folder of *.txt read in
    name order; --tokenizer, --block-size), tokens:DIR (DIR/train.bin, val.bin and optionally
    test.bin of token ids as nanoGPT and llm.c write them, with meta.pkl or meta.json), or
    PATH.py:FUNCTION: FUNCTION() returns a dptrain.data.Split of your own datasets (see
    dptrain.data.load_dataset)."""
    augment: Literal["auto", "on", "off"] = field(default="auto", metadata=cli(
        negative="no-augment"))
    """Random augmentation of training images: on, off, or auto (on where the dataset's
    published results use it: cifar10, imagefolder). cifar10 and mnist: a crop of the image
    padded by 4 black pixels and a horizontal flip; imagefolder: a random resized crop and a
    flip."""
    image_size: int = 0
    """imagefolder: side of the square images the network sees (0: 224, ImageNet's);
    evaluation resizes the shorter side to image-size / 0.875 and takes the centre crop."""
    mean: str = ""
    """imagefolder: per-channel mean of 0-1 pixel values, comma-separated (with std; empty:
    estimated from a sample of the training images)."""
    std: str = ""
    """imagefolder: per-channel standard deviation of 0-1 pixel values, comma-separated."""
    bad_images: Literal["error", "skip"] = field(default="error", metadata=cli(choices=True))
    """imagefolder: an image that cannot be decoded stops the run with one line naming it
    (error), or is left out of its batch and counted in summary.json (skip)."""
    lookback: int = 24
    """Time series: values of each series a window shows the model (its input); tagi-lstm's
    default is 48."""
    horizon: int = 1
    """Time series: values after the window the model predicts at once (its targets); a
    longer forecast feeds its predictions back as inputs."""
    block_size: int = 64
    """text: and tokens: data: tokens in one window, the model's context length; a window's
    targets are its tokens shifted by one. Training windows start at an offset drawn from
    --seed and the epoch, validation and test windows at the start of their part."""
    tokenizer: Literal["char", "byte"] = field(default="char", metadata=cli(choices=True))
    """text: data: char (one id per distinct character of the training part, plus one id for
    a character it never had, counted in summary.json) or byte (the 256 byte values of the
    UTF-8 text; no vocabulary to build)."""
    val_size: str = "auto"
    """The validation part, which chooses the best epoch (--monitor, best/) while the test part
    only reports: a count (an integer >= 1) or a fraction (0.1) of the training samples, held
    out of them by a draw of --seed; a time series' validation time steps, before its test
    part; a text's tokens after its training part (auto: its last 0.1, nanoGPT's 90/10).
    auto: the dataset's own validation part (a series' middle 10 %, an image folder's
    val/ beside its test/, your Split's validation), else 0.1 of the training part. (none:
    no validation part and the test metric monitored, which only a run started before
    validation parts existed resumes with; dptrain sets it itself.)"""
    test_size: str = "auto"
    """Time series: the test part, its last time steps, as a count or a fraction of the
    series (auto: 0.2). text: data: its last tokens, after the validation part (auto: none;
    the test metrics are then the validation part's)."""
    season: int = 0
    """Time series: the seasonal period m, in time steps, of the seasonal naive baseline and
    the seasonal MASE (0: from the time spacing: a day and a week for hourly values, the best
    of the two on the validation part; docs/tutorials/forecasting.md)."""
    forecast_every: int = 0
    """Time series: rolling-origin evaluation: forecast K steps from an origin, reveal them,
    move the origin K steps on, until the test part is covered (0: one recursive forecast of
    the whole test part)."""
    time_features: str = ""
    """Time series: calendar features of the time column as known covariates, comma-separated
    from minute, hour, weekday, month, dayofyear, or auto (those the time spacing gives: hour
    and weekday for values spaced below a day; none for times that are not dates); empty:
    none. tagi-lstm's default is auto."""
    covariates: str = ""
    """Time series in a CSV: its columns (comma-separated) that are known covariates, shared
    by the series (in a long file, the same at one time on every series' row), fed with the
    values at every input step and over the horizon, never predicted."""
    workers: int = field(default=-1, metadata=resumable())
    """DataLoader worker processes per process that decode batches ahead of the training step
    (0: decode in the training process; -1: 0 for data held in memory and for token windows,
    else a share of the process's cores). Never changes a result."""

    def __post_init__(self) -> None:
        if self.augment not in ("auto", "on", "off"):
            raise bad_value(self, "augment", "on, off or auto")
        if self.image_size < 0:
            raise bad_value(self, "image_size", "an integer >= 0 (0: 224)")
        if self.bad_images not in ("error", "skip"):
            raise bad_value(self, "bad_images", "error or skip")
        check_at_least(self, ("lookback", "horizon", "block_size"), 1)
        if self.tokenizer not in TOKENIZERS:
            raise bad_value(self, "tokenizer", " or ".join(TOKENIZERS))
        if self.val_size != NO_VALIDATION:
            parse_size(self.val_size, option="val-size")
        parse_size(self.test_size, option="test-size")
        check_at_least(self, ("season", "forecast_every"), 0)
        if self.workers < -1:
            raise bad_value(self, "workers", "an integer >= 0 (or -1: automatic)")

    def loader_options(self) -> dict[str, Any]:
        """The options of the dataset's reader that are set (the image-folder ones)."""
        options = {"image_size": self.image_size, "mean": self.mean, "std": self.std,
                   "bad_images": "" if self.bad_images == "error" else self.bad_images}
        return {k: v for k, v in options.items() if v}

    def series_options(self) -> dict[str, Any]:
        """lookback, horizon, the sizes of the parts and the forecast protocol: every one set
        for a time series, those changed for other data (which are refused; --val-size is for
        every dataset)."""
        options = {"lookback": self.lookback, "horizon": self.horizon,
                   "test_size": self.test_size, "season": self.season,
                   "forecast_every": self.forecast_every, "time_features": self.time_features,
                   "covariates": self.covariates}
        defaults = DataConfig()
        if self.dataset.partition(":")[0] in SERIES_DATASETS:
            if self.val_size not in ("auto", NO_VALIDATION):
                options["val_size"] = self.val_size
            return {k: v for k, v in options.items()
                    if not (k in ("val_size", "test_size") and v == "auto")}
        if self.dataset.partition(":")[0] in TOKEN_DATASETS:
            options.pop("test_size")  # token data's test part: token_options
        return {k: v for k, v in options.items() if v != getattr(defaults, k)}

    def token_options(self, *, seed: int) -> dict[str, Any]:
        """The options of a text: or tokens: dataset's reader (every one for those), or for
        other data those changed (which are refused)."""
        kind = self.dataset.partition(":")[0]
        if kind == "text":
            sizes = {k: getattr(self, k) for k in ("val_size", "test_size")
                     if getattr(self, k) not in ("auto", NO_VALIDATION)}
            return {"block_size": self.block_size, "tokenizer": self.tokenizer, **sizes,
                    "seed": seed}
        if kind == "tokens":
            if self.val_size not in ("auto", NO_VALIDATION):
                raise ConfigError(f"--val-size {self.val_size}: {self.dataset} has a "
                                  f"validation part of its own (val.bin); --val-size is for "
                                  f"data without one")
            if self.test_size != "auto":
                raise ConfigError(f"--test-size {self.test_size}: {self.dataset}'s test part "
                                  f"is its test.bin; --test-size is for text: data")
            if self.tokenizer != "char":
                raise ConfigError(f"--tokenizer {self.tokenizer}: {self.dataset} is "
                                  f"tokenized already; --tokenizer is for text: data")
            return {"block_size": self.block_size, "seed": seed}
        defaults = DataConfig()
        return {k: getattr(self, k) for k in ("block_size", "tokenizer")
                if getattr(self, k) != getattr(defaults, k)}


NO_VALIDATION = "none"
"""`val_size` of a run started before validation parts existed: no validation part, the test
metric monitored, as such a run was (train/options.py, BEFORE_OPTION)."""


def load_split(config: DataConfig, *, seed: int, vocabulary: Any = None) -> Split:
    """The dataset, its training images augmented as `config` asks (draws seeded by `seed`).
    `vocabulary` (token data only): the `Vocabulary` of the run being fine-tuned, which the
    text must keep to."""
    options = config.loader_options()
    kind = config.dataset.partition(":")[0]
    if options and kind != "imagefolder":
        raise ConfigError(f"{', '.join(flag(k) for k in options)}: for imagefolder datasets; "
                          f"{config.dataset} is not one")
    series = config.series_options()
    if series and kind not in SERIES_DATASETS:
        raise ConfigError(f"{', '.join(flag(k) for k in series)}: for time series "
                          f"({', '.join(SERIES_DATASETS)}); {config.dataset} is not one")
    tokens = config.token_options(seed=seed)
    if vocabulary is not None:
        if kind not in TOKEN_DATASETS:
            raise ConfigError(f"{config.dataset}: a vocabulary is for token data (text:PATH, "
                              f"tokens:DIR)")
        tokens["vocabulary"] = vocabulary
    if tokens and kind not in TOKEN_DATASETS:
        raise ConfigError(f"{', '.join(flag(k) for k in tokens)}: for token data "
                          f"(text:PATH, tokens:DIR); {config.dataset} is not one")
    protocol = {k: series.pop(k) for k in ("season", "forecast_every") if k in series}
    calendar = series.pop("time_features", "")
    if not series.get("covariates"):
        series.pop("covariates", None)
    elif kind != "series":
        raise ConfigError(f"--covariates: columns of a series:PATH.csv file; {config.dataset} "
                          f"has none")
    split = with_validation(load_dataset(config.dataset, **options, **series, **tokens),
                            config, seed=seed)
    if split.series is not None:
        names = parse_feature_list(calendar, split.series.times, split.name) if calendar \
            else []
        split = with_covariates(split, *time_features(split.series.times, names))
        split = with_protocol(split, **protocol)
    if config.augment == "off" or (config.augment == "auto" and not split.augment_by_default):
        return split
    if not isinstance(split.train, (ImageDataset, ImageFolderDataset)):
        raise ConfigError(f"--augment is for image datasets (mnist, cifar10, imagefolder); "
                          f"{config.dataset} has inputs {split.input_shape}")
    return split.with_train(split.train.with_augmentation(seed=seed))


def with_validation(split: Split, config: DataConfig, *, seed: int) -> Split:
    """`split` with the validation part `config.val_size` asks for: the dataset's own (a
    series' is sized by its loader), else held out of the training part by a draw of
    `seed`; none at all for a run from before validation parts (`NO_VALIDATION`)."""
    if config.val_size == NO_VALIDATION:
        return replace(split, validation=None)
    if config.dataset.partition(":")[0] in (*SERIES_DATASETS, *TOKEN_DATASETS):
        return split  # sized by its reader
    if split.validation is not None:
        if config.val_size != "auto":
            raise ConfigError(f"--val-size {config.val_size}: {config.dataset} has a "
                              f"validation part of its own ({len(split.validation)} samples); "
                              f"--val-size is for data without one")
        return split
    size = parse_size(config.val_size, option="val-size") or DEFAULT_VAL_FRACTION
    return hold_out(split, size, seed=seed)


def with_protocol(split: Split, *, season: int = 0, forecast_every: int = 0) -> Split:
    """The series' forecast protocol: its seasonal period (0: inferred) and rolling origins
    every `forecast_every` steps (0: one forecast of the whole test part).

    Raises:
        ConfigError: a season longer than the training part, or K larger than the test part.
    """
    series = split.series
    test_steps = series.values.shape[1] - series.val_end
    if season > series.train_end:
        raise ConfigError(f"{split.name}: --season {season} is longer than the training part "
                          f"({series.train_end} time steps): the naive forecast would have no "
                          f"value one season back")
    if forecast_every > test_steps:
        raise ConfigError(f"{split.name}: --forecast-every {forecast_every} is larger than the "
                          f"test part ({test_steps} time steps)")
    return dataclasses.replace(split, series=dataclasses.replace(
        series, season=season, forecast_every=forecast_every))


def resolve_workers(config: DataConfig, split: Split, cores: int) -> int:
    """How many loader workers a process gets: `config.workers`, or when automatic none for
    data in memory (a batch is one gather) and up to half the process's `cores`, at least one,
    for data decoded from files."""
    if config.workers >= 0:
        return config.workers
    if isinstance(split.train, (ArrayDataset, TokenWindows)):
        return 0  # a batch is one gather, or a few slices of a mapped file
    return max(1, min(4, cores // 2))
