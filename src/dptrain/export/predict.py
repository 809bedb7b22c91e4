"""`dptrain predict FILE.pt2|FILE.onnx`: an exported model's predictions, decoded as `load_run`
decodes those of its run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dptrain.data import load_dataset
from dptrain.data.config import DataConfig, load_split
from dptrain.data.loader import fetch_batch
from dptrain.errors import ConfigError
from dptrain.export.check import load_exported, read_metadata
from dptrain.inference import Prediction, class_probabilities
from dptrain.tagi import HRCSoftmax


def predict_exported(path: str | Path, spec: str | None = None, part: str = "test", *,
                     batch_size: int = 256) -> tuple[Prediction, dict[str, Any]]:
    """`dptrain predict FILE.pt2|FILE.onnx`: the exported model's predictions for a dataset's
    part (default: the run's dataset, named in the metadata), decoded as `load_run` decodes
    them; also the metadata."""
    meta = read_metadata(path)
    if meta["outputs"] == ["logits"]:
        raise ConfigError(f"{path}: a language model's export gives logits per position, not "
                          f"a table of predictions: call it through "
                          f"dptrain.export.load_exported, or sample text from its run with "
                          f"dptrain generate")
    exported = load_exported(path)
    if spec is not None:
        split = load_dataset(spec)
    else:  # the run's own data, read with the run's data options (image size, lookback...)
        split = load_split(DataConfig(**{**meta["data"], "augment": "off"}), seed=0)
    dataset = getattr(split, part)
    outputs: dict[str, list[torch.Tensor]] = {}
    targets = []
    for start in range(0, len(dataset), batch_size):
        raw, y = raw_batch(split, dataset, start, batch_size)
        targets.append(y)
        for name, value in exported(raw).items():
            outputs.setdefault(name, []).append(value)
    got = {name: torch.cat(values) for name, values in outputs.items()}
    targets = torch.cat(targets)
    if meta["task"] == "regression":
        if split.y_norm is not None:
            targets = split.y_norm.invert(targets)
        return Prediction(got["mean"], got.get("var"), targets), meta
    var = None
    if meta["kind"] == "tagi":  # the probabilities' variance, drawn as load_run draws it:
        hrc = HRCSoftmax(len(meta["class_names"]))  # per batch, from the same seed
        var = torch.cat([class_probabilities(hrc, mu, v)[1] for mu, v in
                         zip(outputs["mu"], outputs["var"])])
    return Prediction(got["probs"], var, targets), meta


def raw_batch(split: Any, dataset: Any, start: int, batch_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [start, start + batch_size) of `dataset`: inputs in the data's own units (a lazy
    dataset read one batch at a time, as it gives them), and targets."""
    index = torch.arange(start, min(start + batch_size, len(dataset)))
    if hasattr(dataset, "x"):
        raw = getattr(dataset, "raw", None)
        if raw is not None:
            return raw[index], dataset.y[index]
        x, y = dataset.x[index], dataset.y[index]
    else:
        x, y = fetch_batch(dataset, 0, index)
    return (split.x_norm.invert(x) if split.x_norm is not None else x), y
