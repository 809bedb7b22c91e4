"""Start a run from another run's weights: `dptrain train --init-from RUN_DIR[:best|last]`.

Weights only: the new run has its own directory, starts at step 0 with a fresh optimizer,
schedule, sampler and σ_v schedule. Tensors are matched by name and shape; one whose shape
differs (a new number of classes) keeps this run's fresh initialisation and is named; a tensor
only one side has is an error unless `init_partial`. For a TAGI network the source's means and
variances become the new run's prior, BatchNorm statistics included (docs/tagi.md, Sequential
learning from a trained run). The new run keeps the source's input normalisation: its model
was trained in that input space (docs/tutorials/finetune_export.md).

    from dptrain.train import init_from

    source = init_from.resolve("runs/torch-mlp-digits-1:best")
    split = init_from.source_space(split, source)          # the new data, normalised as before
    line = init_from.initialise(model, "torch", source, InitOptions(init_from=..., freeze="0"))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.data import Split
from dptrain.data.config import DataConfig, load_split
from dptrain.data.datasets.vocabulary import FILE_NAME as VOCABULARY_FILE
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.data.normalisation import as_record, from_record, renormalised
from dptrain.errors import CheckpointError, ConfigError
from dptrain.fingerprint import params_sha256
from dptrain.models import card as run_card
from dptrain.options import cli, pick
from dptrain.train import checkpoint as ckpt


@dataclass(frozen=True, kw_only=True)
class InitOptions:
    """Where a run's weights start: another run's (fine-tuning, continual learning)."""

    init_from: str = field(default="", metadata=cli(metavar="RUN_DIR[:best|last]"))
    """Start from the model weights of a trained run (its best checkpoint, else its last; :last
    for the last) or of one checkpoint directory; a new run at step 0 with a fresh optimizer
    and schedules, in the source's input normalisation. A tensor whose shape differs (a new
    head) is re-initialised and named. TAGI: the source's posterior becomes the prior."""
    init_partial: bool = False
    """With init-from: leave tensors the source lacks as initialised and ignore those this
    model lacks (else each is an error naming it)."""
    freeze: str = field(default="", metadata=cli(metavar="PREFIX,..."))
    """Torch models: do not train the parameters whose names start with these prefixes
    (comma-separated, e.g. 0,2 or layer1,layer2): out of the optimizer and the gradient
    all-reduce."""

    def __post_init__(self) -> None:
        if self.init_partial and not self.init_from:
            raise ConfigError("init-partial is for a run that starts from another (init-from "
                              "RUN_DIR)")


@dataclass(frozen=True)
class Source:
    """The weights a run starts from, and what the run records of them."""

    spec: str
    checkpoint: Path
    step: int
    kind: str
    """"torch" or "tagi": the learner that wrote it."""
    model: str
    weights: dict[str, torch.Tensor]
    normalisation: dict[str, Any]
    """The source's input (and regression target) normalisation (`data.normalisation`)."""
    vocabulary: Vocabulary | None = None
    """A language model's (its run's vocabulary.json): the ids the new text must be encoded
    with, so that every id means what it meant to the source."""

    @property
    def params_sha256(self) -> str:
        return params_sha256(self.weights)

    def record(self) -> dict[str, Any]:
        """The entries the new run's record gets: resuming it from another source is refused."""
        return {"init_from_checkpoint": str(self.checkpoint),
                "init_from_params_sha256": self.params_sha256,
                "init_normalisation": self.normalisation}


def checkpoint_of(spec: str) -> ckpt.Checkpoint:
    """The checkpoint `RUN_DIR[:best|last]` or `CHECKPOINT_DIR` names."""
    text, _, which = spec.rpartition(":")
    if which not in ("best", "last"):
        text, which = spec, "best"
    path = Path(text).expanduser()
    if (path / "checkpoints").is_dir():
        return ckpt.find(path, which)
    if (path / "meta.json").is_file():
        return ckpt.validate(path)
    raise ConfigError(f"--init-from {spec}: {path} is neither a run directory (no "
                      f"checkpoints/ in it) nor a checkpoint directory (no meta.json)")


def resolve(spec: str) -> Source:
    """The source `spec` names, its weights read (a sharded checkpoint on any world size)."""
    found = checkpoint_of(spec)
    options = found.meta.get("config", {}).get("record") or {}
    if not options:
        raise CheckpointError(f"--init-from {spec}: {found.path} has no record of the options "
                              f"that built it (written outside dptrain train?)")
    learner = found.load_state().get("learner") or {}
    if not learner and (found.path / "sharded").is_dir():
        kind, weights = "torch", ckpt.sharded_model_weights(found.path / "sharded")
    elif "format" in learner:
        kind, weights = "torch", dict(learner["model"])
        nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "module.")
    elif "sigma_v" in learner:
        kind, weights = "tagi", dict(learner["model"])
    else:
        raise CheckpointError(f"--init-from {spec}: {found.path} holds no model weights")
    return Source(spec=spec, checkpoint=found.path, step=found.step, kind=kind,
                  model=options.get("model", "?"), weights=weights,
                  normalisation=source_normalisation(found.path, found.meta, options),
                  vocabulary=source_vocabulary(found.path))


def source_vocabulary(checkpoint: Path) -> Vocabulary | None:
    """The vocabulary of the run that wrote `checkpoint` (RUN/checkpoints/NAME), if it has
    one: a language model's."""
    card = run_card.read(checkpoint.parent.parent)
    if card is not None:
        return card.data.vocabulary
    path = checkpoint.parent.parent / VOCABULARY_FILE
    return Vocabulary.load(path) if path.is_file() else None


def source_normalisation(checkpoint: Path, meta: dict[str, Any], options: dict[str, Any]
                         ) -> dict[str, Any]:
    """The normalisation the source was trained in: its own source's when it was started from
    another run, else its run's model card's; a run from before model cards reads its data
    again for it."""
    kept = (meta.get("run_record") or {}).get("init_normalisation")
    if kept is not None:
        return kept
    card = run_card.read(checkpoint.parent.parent)
    if card is not None:
        return as_record(card.data.x_norm, card.data.y_norm)
    if options.get("dataset", "").partition(":")[0] in ("text", "tokens"):
        return as_record(None, None)  # token ids: nothing to normalise (and no text to read)
    data = dataclasses.replace(pick(DataConfig, options), augment="off")
    split = load_split(data, seed=options.get("seed", 0))
    return as_record(split.x_norm, split.y_norm)


def source_space(split: Split, source: Source) -> Split:
    """`split` normalised with the source's statistics."""
    return renormalised(split, *from_record(source.normalisation))


# ------------------------------------------------------------------------------ initialising
def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def merged_state(fresh: dict[str, torch.Tensor], source: Source, *, partial: bool
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`fresh` with every tensor the source has under the same name and shape replaced by the
    source's; also the `name (old) -> (new)` of each re-initialised one (shape differs)."""
    missing = [n for n in fresh if n not in source.weights]
    unexpected = [n for n in source.weights if n not in fresh]
    if (missing or unexpected) and not partial:
        parts = ([f"this model's {', '.join(missing[:6])} not in the source"] if missing
                 else []) + ([f"the source's {', '.join(unexpected[:6])} not in this model"]
                             if unexpected else [])
        raise ConfigError(f"--init-from {source.spec}: {'; '.join(parts)} ({source.model} -> "
                          f"this model); --init-partial loads the tensors that match")
    merged, reinitialised, loaded = {}, [], 0
    for name, tensor in fresh.items():
        saved = source.weights.get(name)
        if saved is not None and saved.shape != tensor.shape:
            reinitialised.append(f"{name} {_shape(saved)} -> {_shape(tensor)}")
        if saved is None or saved.shape != tensor.shape:
            merged[name] = tensor
        else:
            merged[name], loaded = saved.to(tensor.dtype), loaded + 1
    if not loaded:
        raise ConfigError(f"--init-from {source.spec}: no tensor of {source.model} fits this "
                          f"model (names or shapes all differ)")
    return merged, reinitialised


def freeze(module: nn.Module, spec: str) -> list[str]:
    """Take the parameters under each comma-separated prefix out of training
    (`requires_grad=False`); their names. A prefix that matches nothing is an error."""
    names = [n for n, _ in module.named_parameters()]
    chosen: set[str] = set()
    for prefix in (p.strip().rstrip(".") for p in spec.split(",") if p.strip()):
        matched = [n for n in names if n == prefix or n.startswith(prefix + ".")]
        if not matched:
            tops = list(dict.fromkeys(n.split(".")[0] for n in names))
            raise ConfigError(f"--freeze {prefix}: matches no parameter of this model; its "
                              f"parameters are under {', '.join(tops)}")
        chosen.update(matched)
    if len(chosen) == len(names):
        raise ConfigError(f"--freeze {spec}: freezes every parameter; nothing would train")
    for name, param in module.named_parameters():
        if name in chosen:
            param.requires_grad_(False)
    return [n for n in names if n in chosen]


def initialise(model: Any, kind: str, source: Source | None, options: InitOptions) -> str:
    """Load the source's weights into `model` (a fresh network of kind "torch" or "tagi") and
    freeze what `options.freeze` names; the one line that says what was done."""
    if options.freeze and kind != "torch":
        raise ConfigError("--freeze is for torch models; a TAGI network learns every "
                          "parameter from the data")
    said = []
    if source is not None:
        if source.kind != kind:
            raise ConfigError(f"--init-from {source.spec}: a {source.kind} checkpoint "
                              f"({source.model}); this run's model is a {kind} model")
        merged, reinitialised = merged_state(dict(model.state_dict()), source,
                                             partial=options.init_partial)
        model.load_state_dict(merged)
        said.append(f"init-from {source.checkpoint} (step {source.step}, params_sha256 "
                    f"{source.params_sha256[:12]})")
        if reinitialised:
            said.append(f"re-initialised {', '.join(reinitialised)}")
    if options.freeze:
        frozen = freeze(model, options.freeze)
        said.append(f"frozen {len(frozen)} parameter tensor(s) under {options.freeze}")
    return "; ".join(said)
