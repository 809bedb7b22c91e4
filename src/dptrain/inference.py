"""Use a trained run: `load_run(RUN_DIR)` gives its model, ready to predict in one process.

    import dptrain

    run = dptrain.load_run("runs/tagi-cnn-20260101-120000")     # best checkpoint, else last
    probs, probs_var = run.predict(raw_images)                   # classification: (B, K) each
    split = run.load_data()                                      # the run's dataset again
    out = run.predict_split(split)                               # Prediction of its test part

Inputs are raw, in the data's own units (pixel values 0-255, table features as in the file):
the run's input normalisation (fitted on its training data) is applied here. Outputs are
decoded: class probabilities (TAGI: with their variance under the network's output
distribution), or for regression the predictive mean and variance in the targets' units (torch
regression models give a mean only). `dptrain predict RUN_DIR --out predictions.csv` writes the
same as a table.

The run directory alone rebuilds the model (its model card, `dptrain.models.card`): the
training data and a model file may be gone. Only `load_data()` without a dataset reads the
run's own data again.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dptrain.data import ArrayDataset, load_dataset
from dptrain.data.config import DataConfig, load_split
from dptrain.data.loader import fetch_batch
from dptrain.data.normalisation import from_record, renormalised
from dptrain.data.datasets.vocabulary import FILE_NAME as VOCABULARY_FILE
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.data.datasets.registry import SERIES_DATASETS, TOKEN_DATASETS
from dptrain.errors import CheckpointError, ConfigError, DataError
from dptrain.generation import TagiLanguageModel, generate_text
from dptrain.learners.build import create_model, model_split
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.learners.forecast import Forecast, calibrated_test
from dptrain.learners.window_scaling import WindowScaling
from dptrain.learners.window_scaling import choose as choose_window_scaling
from dptrain.models import DataSpec
from dptrain.models import card as run_card
from dptrain.models.user_file import is_model_file, model_file_sha256
from dptrain.options import pick
from dptrain.tagi import HRCSoftmax, split_heteros
from dptrain.train import checkpoint as ckpt

MC_DRAWS = 256
"""Draws of the output distribution for the variance of TAGI class probabilities."""


@dataclasses.dataclass
class Prediction:
    """Per sample: `mean` (class probabilities, or regression means), `var` (their variance;
    None where the model has none), and the targets if the data had them."""

    mean: torch.Tensor
    var: torch.Tensor | None
    targets: torch.Tensor | None = None

    @property
    def labels(self) -> torch.Tensor:
        return self.mean.argmax(1)


class TrainedRun:
    """The model of one run, with the run's input normalisation and output decoding."""

    def __init__(self, run_dir: Path, checkpoint: Path, record: dict[str, Any], data: DataSpec,
                 model: Any, kind: str, sigma_v: float, hrc_link: str = "probit",
                 averaged: bool = False, split: Any = None, notes: tuple[str, ...] = (),
                 window_scaling: WindowScaling | None = None) -> None:
        self.run_dir, self.checkpoint, self.model, self.kind = run_dir, checkpoint, model, kind
        self.averaged = averaged
        """The weights are the run's EMA (--ema), not the live ones."""
        self.model_config = pick(ModelConfig, record)
        self.dataset: str = record["dataset"]
        self.data = data
        """What the model was built for (`dptrain.models.DataSpec`), from the run's card."""
        self.task, self.num_classes = data.task, data.num_classes
        self.x_norm, self.y_norm = data.x_norm, data.y_norm
        self._sigma_v = sigma_v
        self._record = record
        self._split = split
        self.vocabulary = data.vocabulary
        """Token data only: the run's Vocabulary (vocabulary.json)."""
        self.notes = notes
        self.window_scaling = window_scaling
        """A time series run whose windows were scaled by their own mean and spread."""
        """One line each on how the run was loaded: the model file's copy it was built from,
        or that a run from before model cards read its data again."""
        if kind == "tagi" and data.task == "classification":
            self.hrc = HRCSoftmax(data.num_classes, link=hrc_link)

    # --------------------------------------------------------------------------------- data
    def load_data(self, spec: str | None = None):
        """The run's dataset, read again with the run's data options (it must still be where
        the run found it); or `spec`, a dataset spelling of `dptrain.data.load_dataset`, read
        with the run's options where it is of the run's kind (an image folder's image size; a
        time series' lookback and protocol, token data's block size and vocabulary), so that
        the model sees inputs as it was trained on them."""
        if spec is None and self._split is not None:
            return self._split
        config = dataclasses.replace(pick(DataConfig, self._record), augment="off")
        kind = config.dataset.partition(":")[0]
        if spec is not None and kind not in (*SERIES_DATASETS, *TOKEN_DATASETS):
            # data of the run's kind read as the run read its own (an image folder's size)
            same_kind = spec.partition(":")[0] == kind
            return load_dataset(spec, **(config.loader_options() if same_kind else {}))
        config = config if spec is None else dataclasses.replace(config, dataset=spec)
        try:
            split = load_split(config, seed=self._record.get("seed", 0),
                               vocabulary=self.vocabulary)
        except (ConfigError, DataError) as err:
            if spec is not None:
                raise
            raise type(err)(f"{self.run_dir}: its data {self.dataset} cannot be read ({err}); "
                            f"the model needs only the inputs: pass them (predict --data "
                            f"DATASET)") from None
        return model_split(self.model_config, split)

    def examples(self) -> torch.Tensor:
        """Raw inputs of the run's test part (a text without one: of its validation part), as
        the run kept them (up to 512): what `dptrain export` checks its graph on."""
        kept = run_card.read_examples(self.run_dir) if self._split is None else None
        return kept if kept is not None else run_card.raw_examples(self.load_data())

    # ---------------------------------------------------------------------------- predicting
    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        raw = torch.as_tensor(raw)
        if self.x_norm is None and not raw.is_floating_point():
            return raw  # token ids: an embedding takes them as they are
        return (self.x_norm.apply(raw.float()) if self.x_norm is not None else raw).float()

    @torch.no_grad()
    def predict(self, raw: torch.Tensor, *, batch_size: int = 256
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean, var) for raw inputs (B, *input_shape); see the module docstring."""
        means, variances = [], []
        for start in range(0, len(raw), batch_size):
            m, v = self._predict_normalised(self.normalise(raw[start:start + batch_size]))
            means.append(m)
            variances.append(v)
        mean = torch.cat(means)
        return mean, None if variances[0] is None else torch.cat(variances)

    def predict_split(self, split: Any, part: str = "test", *, batch_size: int = 256
                      ) -> Prediction:
        """Predictions for every sample of `split.test` (or `split.train`), with its targets in
        the data's units. The split's inputs are mapped back to raw values with the split's own
        normalisation first, so a split loaded from other files of the same kind works too. A
        dataset read lazily (image folders, your own) is predicted as it gives its samples
        (evaluation transform, its own normalisation)."""
        dataset = getattr(split, part)
        if isinstance(dataset, ArrayDataset):
            raw = raw_inputs(dataset, split.x_norm)
            mean, var = self.predict(raw, batch_size=batch_size)
            targets = dataset.y
        else:
            mean, var, targets = self._predict_lazily(dataset, batch_size)
        if self.task == "regression" and split.y_norm is not None:
            targets = split.y_norm.invert(targets)
        return Prediction(mean, var, targets)

    @torch.no_grad()
    def _predict_lazily(self, dataset: Any, batch_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        means, variances, targets = [], [], []
        for start in range(0, len(dataset), batch_size):
            x, y = fetch_batch(dataset, 0, torch.arange(start, min(start + batch_size,
                                                                    len(dataset))))
            m, v = self._predict_normalised(x.float())
            means.append(m)
            variances.append(v)
            targets.append(y)
        var = None if variances[0] is None else torch.cat(variances)
        return torch.cat(means), var, torch.cat(targets)

    def _predict_normalised(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "torch":
            self.model.eval()
            out = self.model(x)
            if self.task == "classification":
                return torch.softmax(out.float(), dim=1), None
            return self._to_data_units(out.float(), None)
        self.model.eval()
        if self.task == "classification":
            return self._class_probabilities(*self.model(x.to(self.model.dtype)))
        return self._to_data_units(*self.regression_moments(x))

    def regression_moments(self, mu_x: torch.Tensor, var_x: torch.Tensor | None = None,
                           model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A TAGI regression network's predictive mean and total variance (the observation
        noise, σ_v² or the learned one, included) in the normalised units it was trained in,
        for inputs with variances `var_x` (a forecast feeding its predictions back) or
        without; a window-scaled run's windows in their own units and back, as it trained."""
        model = self.model if model is None else model
        stats = None
        if self.window_scaling is not None:
            stats = self.window_scaling.stats(mu_x)
            mu_x, var_x = self.window_scaling.inputs(mu_x, var_x, stats)
        inputs = (mu_x,) if var_x is None else (mu_x, var_x)
        mu, var = model(*(t.to(model.dtype) for t in inputs))
        if self.model_config.heteroscedastic:
            pred = split_heteros(mu, var)
            mean, var = pred.mean, pred.total_var
        else:
            mean, var = mu, var + self._sigma_v ** 2
        return (mean, var) if stats is None else WindowScaling.outputs(mean, var, stats)

    def generate(self, prompt: str, *, max_new_tokens: int = 200, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0,
                 report: Callable[[str], None] | None = None) -> str:
        """A language model's run (--model torch-gpt on text:/tokens:): `prompt` and the
        `max_new_tokens` tokens it samples after it, as text (`dptrain.generation`); the same
        `seed` gives the same text. `report` receives the one-line note of a prompt longer
        than the context (its last block is kept)."""
        block_size = self.data.input_shape[0]
        model = self.model
        if self.vocabulary is not None and self.kind == "tagi" and self.hrc is not None:
            model = TagiLanguageModel(self.model, self.hrc, block_size)
        if self.vocabulary is None or not hasattr(model, "generate"):
            raise ConfigError(f"{self.run_dir}: generate is for language models trained on "
                              f"token data (--model torch-gpt or tagi-gpt --dataset "
                              f"text:PATH); this run is {self.model_config.model} on "
                              f"{self.dataset}")
        return generate_text(model, self.vocabulary, block_size, prompt,
                             max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, seed=seed, report=report)

    @torch.no_grad()
    def forecast(self, split: Any = None) -> Forecast:
        """A TAGI time-series run: the recursive forecast of its test part under the run's
        protocol (data units, the observation noise in the variance, scaled as chosen on the
        validation part), as the run reported it in summary.json; of `split`'s test part
        (`load_data(spec)`) where given, else of the run's own data."""
        series = (split if split is not None else self.load_data()).series
        if series is None or self.kind != "tagi":
            raise ConfigError(f"{self.run_dir}: forecasts are for TAGI models trained on a "
                              f"time series (--dataset sine, seasonal, series:PATH.csv); this "
                              f"run is {self.model_config.model} on {self.dataset}")
        self.model.eval()
        return calibrated_test(self.regression_moments, series)[0]

    def _class_probabilities(self, mu: torch.Tensor, var: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """HRC probabilities, and their variance over draws of the outputs ~ N(mu, var)."""
        return class_probabilities(self.hrc, mu, var)

    def _to_data_units(self, mean: torch.Tensor, var: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.y_norm is None:
            return mean, var
        scale = self.y_norm.std.to(mean.dtype)
        return self.y_norm.invert(mean), None if var is None else var * scale * scale

    def __repr__(self) -> str:
        return (f"TrainedRun({str(self.run_dir)!r}, model {self.model_config.model}, "
                f"checkpoint {self.checkpoint.name})")


def class_probabilities(hrc: HRCSoftmax, mu: torch.Tensor, var: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """HRC probabilities of TAGI output moments (a closed form), and their variance over
    MC_DRAWS draws of the outputs ~ N(mu, var) (seeded: the same for the same moments)."""
    probs = hrc.probabilities(mu, var)
    gen = torch.Generator(device=mu.device).manual_seed(0)
    draws = mu + var.sqrt() * torch.randn((MC_DRAWS, *mu.shape), generator=gen,
                                          dtype=mu.dtype, device=mu.device)
    sampled = hrc.probabilities(draws.reshape(-1, mu.shape[1]),
                                torch.zeros_like(draws).reshape(-1, mu.shape[1]))
    return probs, sampled.reshape(MC_DRAWS, *probs.shape).var(0)


def raw_inputs(dataset: Any, x_norm: Any) -> torch.Tensor:
    """A dataset's inputs in the data's own units."""
    raw = getattr(dataset, "raw", None)
    if raw is not None:
        return raw
    return dataset.x if x_norm is None else x_norm.invert(dataset.x)


def find_checkpoint(run_dir: Path, which: str = "best") -> ckpt.Checkpoint:
    """`which` = "best" (the best checkpoint if the run kept one, else the last) or "last"."""
    if which not in ("best", "last"):
        raise ConfigError(f"which checkpoint: expected 'best' or 'last', got {which!r}")
    return ckpt.find(run_dir, which)


def load_run(run_dir: str | Path, *, which: str = "best", ema: bool = True) -> TrainedRun:
    """The trained model of a `dptrain train` run directory (see the module docstring): the
    EMA of its weights when the run kept one (`ema=False`: the live weights).

    The run alone rebuilds it: its model card (`dptrain.models.card`) holds the model's
    configuration and the data's shape, normalisation and vocabulary, and a copy of a model
    file (`--model PATH.py:FUNCTION`). A run written before model cards reads its dataset
    again, which must still be where the run found it, and says so in `notes`.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory not found: {run_dir}")
    found = find_checkpoint(run_dir, which)
    record = found.meta.get("config", {}).get("record") or {}
    if not record:
        raise CheckpointError(f"{found.path}: no record of the options that built this run "
                              f"(written by a Trainer outside dptrain train?)")
    learner = _learner_state(found)
    model_config = pick(ModelConfig, record)
    card = run_card.read(run_dir)
    if card is not None:
        data, split, notes = card.data, None, ()
        if card.model_file is not None:
            model_config = dataclasses.replace(model_config,
                                               model=card.model_file.spec_in(run_dir))
            notes = (card.model_file.said(),)
    else:
        split = _data_of_a_run_without_card(run_dir, found, record, model_config)
        data = DataSpec.of(split)
        notes = (f"{run_dir} was written before runs kept their model card: its data "
                 f"({record['dataset']}) were read again to rebuild the model",)
    model, kind = create_model(model_config, data, seed=record.get("seed", 0),
                               dataset=record["dataset"])
    # A run with EMA kept the averaged weights as its model: monitored, best/, used here.
    averaged = learner.get("ema") if ema else None
    weights = dict(averaged or learner["model"])
    if kind == "torch":
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "module.")
    model.load_state_dict(weights)
    sigma_v, hrc_link = _decoding(kind, learner, record)
    return TrainedRun(run_dir, found.path, record, data, model, kind, sigma_v, hrc_link,
                      averaged=bool(averaged), split=split, notes=notes,
                      window_scaling=_window_scaling(kind, card, data, split, record))


def _window_scaling(kind: str, card: Any, data: DataSpec, split: Any,
                    record: dict[str, Any]) -> WindowScaling | None:
    """A TAGI series run's window scaling as it trained: its card says; a run from before
    cards decides again on its data (a record without the option: off, as it ran)."""
    if kind != "tagi" or data.series is None:
        return None
    if card is not None:
        on = card.decoding.get("window_scaling", False)
        return WindowScaling(data.series.lookback, data.series.num_features) if on else None
    return choose_window_scaling(split.series, record.get("window_scaling", "off"),
                                 record["dataset"])


def _learner_state(found: ckpt.Checkpoint) -> dict[str, Any]:
    state = found.load_state()
    if not state.get("learner") and (found.path / "sharded").is_dir():
        # FSDP: its shards, of whatever world size wrote them, read whole in this process
        state["learner"] = {"model": ckpt.sharded_model_weights(found.path / "sharded")}
    if not state.get("learner"):
        raise CheckpointError(f"{found.path}: holds no learner state")
    return state["learner"]


def _decoding(kind: str, learner: dict[str, Any], record: dict[str, Any]) -> tuple[float, str]:
    """The σ_v and class-probability link the run decoded with at that checkpoint; pytagi's
    probit for a checkpoint written before the link could be chosen."""
    sigma_v = pick(LearnerConfig, record).sigma_v
    saved_sigma = learner.get("sigma_v") if kind == "tagi" else None
    if saved_sigma is not None:
        sigma_v = saved_sigma["current"]
    return sigma_v, (learner.get("hrc_link") if kind == "tagi" else None) or "probit"


def _data_of_a_run_without_card(run_dir: Path, found: ckpt.Checkpoint, record: dict[str, Any],
                                model_config: ModelConfig) -> Any:
    """A run from before model cards: its data read again (and its model file checked
    against the run's record of it)."""
    digest = found.meta.get("run_record", {}).get("model_sha256")
    if is_model_file(model_config.model) and digest is not None:
        if model_file_sha256(model_config.model) != digest:
            path = model_config.model.rpartition(":")[0]
            raise CheckpointError(f"{path} changed since the run was trained (sha256 differs "
                                  f"from the run's record): the checkpoint may not fit it")
    data_config = dataclasses.replace(pick(DataConfig, record), augment="off")
    # token data: the ids the model was trained on (a fine-tuned run's are its source's)
    vocabulary = (Vocabulary.load(run_dir / VOCABULARY_FILE)
                  if (run_dir / VOCABULARY_FILE).is_file() else None)
    split = model_split(model_config, load_split(data_config, seed=record.get("seed", 0),
                                                 vocabulary=vocabulary))
    kept = found.meta.get("run_record", {}).get("init_normalisation")
    if kept is not None:  # started from another run: trained in that run's input space
        split = renormalised(split, *from_record(kept))
    return split


def write_forecast(path: str | Path, forecast: Forecast, series: Any) -> None:
    """One row per series and test time step: series, time, origin (the time of the first
    step of the forecast this value belongs to: the test part's first for one forecast of the
    whole part, rolling with `--forecast-every`), observed (empty where missing), forecast
    mean and variance, in the data's units."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["series", "time", "origin", "observed", "mean", "var"])
        origins = forecast.origins.tolist()
        for s, name in enumerate(series.names):
            for k in range(forecast.mean.shape[1]):
                observed = forecast.observed[s, k].item()
                writer.writerow([name, series.times[forecast.start + k],
                                 series.times[origins[k]],
                                 "" if observed != observed else f"{observed:.9g}",
                                 f"{forecast.mean[s, k].item():.9g}",
                                 f"{forecast.var[s, k].item():.9g}"])
    tmp.replace(path)


def write_predictions(path: str | Path, prediction: Prediction, task: str) -> None:
    """One row per sample: index, target (if known), then the decoded outputs."""
    mean, var = prediction.mean, prediction.var
    k = mean.shape[1]
    if task == "classification":
        columns = ["index"] + (["label"] if prediction.targets is not None else []) + \
            ["predicted"] + [f"p{i}" for i in range(k)] + \
            ([f"p{i}_var" for i in range(k)] if var is not None else [])
    else:
        columns = ["index"] + ([f"y{i}" for i in range(k)] if prediction.targets is not None
                               else []) + [f"mean{i}" for i in range(k)] + \
            ([f"var{i}" for i in range(k)] if var is not None else [])
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for i in range(len(mean)):
            row: list[Any] = [i]
            if prediction.targets is not None:
                t = prediction.targets[i]
                row += [int(t)] if task == "classification" else [f"{v:.9g}" for v in
                                                                    t.reshape(-1).tolist()]
            if task == "classification":
                row.append(int(mean[i].argmax()))
            row += [f"{v:.9g}" for v in mean[i].tolist()]
            if var is not None:
                row += [f"{v:.9g}" for v in var[i].tolist()]
            writer.writerow(row)
    tmp.replace(path)

