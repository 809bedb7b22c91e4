"""The run's model card: what rebuilds a run's model and maps inputs to outputs, kept in the
run directory when training starts, so that loading, predicting, generating, exporting and
fine-tuning need the run alone, never its training data or the model file it was built from.

    RUN/model/card.json      the model's configuration (family, sizes, seed), the data it was
                             built for (`DataSpec`: input shape and dtype, task and outputs,
                             normalisation, vocabulary, series layout, class names) and how
                             a TAGI head decodes (σ_v, the class-probability link)
    RUN/model/examples.pt    up to 512 raw inputs of the test part, which `dptrain export`
                             checks an exported graph against the live model on
    RUN/model/code/NAME.py   for --model NAME.py:FUNCTION, a copy of the file (its sha256 in
                             the card)
    RUN/vocabulary.json      token data: the vocabulary (also in the card)

A run written before cards existed has none: it loads by reading its data again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain.data import Split
from dptrain.data.datasets.base import Skipped
from dptrain.data.datasets.vocabulary import FILE_NAME as VOCABULARY_FILE
from dptrain.errors import CheckpointError, DataError
from dptrain.models.data_spec import DataSpec
from dptrain.models.registry import get_model
from dptrain.models.user_file import is_model_file, model_file_sha256

CARD = Path("model") / "card.json"
EXAMPLES = Path("model") / "examples.pt"
CODE = Path("model") / "code"
FORMAT = 1
MAX_EXAMPLES = 512
EXAMPLES_BYTES = 8 << 20
"""At most this much of raw example inputs (fewer samples of large images)."""


@dataclass(frozen=True)
class ModelFile:
    """A user's model file as the run keeps it."""

    spec: str
    """--model as given: PATH.py:FUNCTION."""
    copy: str
    """The copy's path inside the run directory."""
    sha256: str

    def spec_in(self, run_dir: Path) -> str:
        """The --model spelling that builds from the run's copy."""
        return f"{run_dir / self.copy}:{self.spec.rpartition(':')[2]}"

    def said(self) -> str:
        """Which file the run's model is built from, and how the original stands now."""
        original = self.spec.rpartition(":")[0]
        digest = model_file_sha256(self.spec) if Path(original).is_file() else None
        now = ("is gone" if digest is None else "is unchanged" if digest == self.sha256
               else "has changed since (its sha256 differs)")
        return (f"model file {self.spec}: built from the run's copy (sha256 "
                f"{self.sha256[:12]}); {original} {now}")


@dataclass(frozen=True)
class ModelCard:
    model: str
    """--model as given."""
    family: str | None
    """The registered family's name; None for a model file."""
    config: dict[str, Any]
    """The run's `ModelConfig` fields."""
    seed: int
    data: DataSpec
    decoding: dict[str, Any]
    """TAGI: the σ_v and class-probability link the run began with (a checkpoint's own, where
    it has them, come first)."""
    model_file: ModelFile | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": self.model, "family": self.family,
                "config": self.config, "seed": self.seed, "data": self.data.to_json(),
                "decoding": self.decoding,
                "model_file": None if self.model_file is None
                else dataclasses.asdict(self.model_file)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelCard:
        if data.get("format") != FORMAT:
            raise CheckpointError(f"model card format {data.get('format')!r}; this dptrain "
                                  f"reads format {FORMAT}")
        model_file = data.get("model_file")
        return cls(model=data["model"], family=data.get("family"), config=data["config"],
                   seed=data["seed"], data=DataSpec.from_json(data["data"]),
                   decoding=data.get("decoding") or {},
                   model_file=None if model_file is None else ModelFile(**model_file))


def read(run_dir: str | Path) -> ModelCard | None:
    """The run's card; None for a run written before cards existed."""
    path = Path(run_dir) / CARD
    if not path.is_file():
        return None
    try:
        return ModelCard.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: not a model card dptrain can read "
                              f"({type(err).__name__}: {err})") from None


def read_examples(run_dir: str | Path) -> torch.Tensor | None:
    path = Path(run_dir) / EXAMPLES
    return torch.load(path, weights_only=True) if path.is_file() else None


def write(run_dir: str | Path, *, model: str, config: dict[str, Any], seed: int, split: Split,
          decoding: dict[str, Any]) -> ModelCard:
    """Write the card of a run that starts training on `split` (rank 0, once: a card already
    there, from the run's first start, is kept). Every file is written whole or not at all."""
    run_dir = Path(run_dir)
    found = read(run_dir)
    if found is not None:
        return found
    data = DataSpec.of(split)
    (run_dir / CARD).parent.mkdir(parents=True, exist_ok=True)
    model_file = _copy_model_file(run_dir, model) if is_model_file(model) else None
    family = None if model_file is not None else get_model(model).family.name
    card = ModelCard(model=model, family=family, config=config, seed=seed, data=data,
                     decoding=decoding, model_file=model_file)
    if data.vocabulary is not None:
        data.vocabulary.save(run_dir / VOCABULARY_FILE)
    _atomic(run_dir / EXAMPLES, lambda f: torch.save(raw_examples(split), f))
    _atomic(run_dir / CARD, lambda f: f.write(json.dumps(card.to_json(), indent=1).encode()))
    return card


def _copy_model_file(run_dir: Path, spec: str) -> ModelFile:
    source = Path(spec.rpartition(":")[0])
    copy = CODE / source.name
    (run_dir / CODE).mkdir(exist_ok=True)
    _atomic(run_dir / copy, lambda f: f.write(source.read_bytes()))
    shutil.copymode(source, run_dir / copy)
    return ModelFile(spec=spec, copy=str(copy), sha256=model_file_sha256(spec))


def _atomic(path: Path, write_to: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write_to(f)
    os.replace(tmp, path)


def raw_examples(split: Split) -> torch.Tensor:
    """The first inputs of the test part (a text without one: of its validation part) in the
    data's own units, as many as `MAX_EXAMPLES` and `EXAMPLES_BYTES` allow."""
    dataset = split.test if split.test is not None and len(split.test) else split.validation
    if hasattr(dataset, "x"):  # arrays: their raw values where they keep them
        count = _count(dataset.x[0], len(dataset))
        raw = getattr(dataset, "raw", None)
        if raw is not None:
            return raw[:count].clone()
        x = dataset.x[:count]
        return (x if split.x_norm is None else split.x_norm.invert(x)).clone()
    kept = _readable(dataset)
    x = torch.stack(kept)
    return x if split.x_norm is None or not x.is_floating_point() else split.x_norm.invert(x)


def _count(sample: torch.Tensor, available: int) -> int:
    per_sample = max(1, sample.numel() * sample.element_size())
    return min(available, MAX_EXAMPLES, max(8, EXAMPLES_BYTES // per_sample))


def _readable(dataset: Any) -> list[torch.Tensor]:
    """The inputs of the first samples a lazily read dataset can give: a file it cannot read
    is left out here, and met, and reported, by the run itself."""
    kept: list[torch.Tensor] = []
    for i in range(len(dataset)):
        try:
            item = dataset[i]
        except DataError:
            continue
        if isinstance(item, Skipped):
            continue
        kept.append(torch.as_tensor(item[0]))
        if len(kept) >= _count(kept[0], len(dataset)):
            break
    if not kept:
        raise DataError("the test part: none of its samples can be read")
    return kept
