"""The registry of model families: dptrain's own, those registered by a program, and those an
installed package declares under the entry-point group `dptrain.models`.

    from dptrain.models import get_model, register

    register(my_family.FAMILY)                  # a Family: its models become --model names
    spec = get_model("tagi-cnn")                 # its kind, builder, defaults and family

A package makes its family known to every process, `dptrain train`'s workers included, with

    [project.entry-points."dptrain.models"]
    myfamily = "mypackage.models:FAMILY"
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from dptrain.errors import ConfigError
from dptrain.models import cnn, gpt, lstm, mlp, resnet
from dptrain.models.data_spec import DataSpec
from dptrain.models.spec import DATA_KINDS, Family, MetricExtras, ModelOptions, ModelSpec

ENTRY_POINTS = "dptrain.models"
BUILT_IN = (mlp.FAMILY, cnn.FAMILY, resnet.FAMILY, lstm.FAMILY, gpt.FAMILY)

FAMILIES: dict[str, Family] = {}
MODELS: dict[str, ModelSpec] = {}
"""Every registered model by its --model name (in registration order)."""
_entry_points_loaded = False


def register(family: Family) -> Family:
    """Make `family`'s models known by name. Registering the same family again is a no-op; a
    name another family already has is refused in one line."""
    unknown = family.data - set(DATA_KINDS)
    if unknown or not family.data:
        raise ConfigError(f"model family {family.name}: data kinds {sorted(family.data)}; "
                          f"expected some of {', '.join(DATA_KINDS)}")
    bad_options = [o for o in family.options if o not in ModelOptions.__dataclass_fields__]
    if bad_options:
        raise ConfigError(f"model family {family.name}: options {bad_options} are not "
                          f"ModelOptions fields")
    if FAMILIES.get(family.name) is family:
        return family
    for spec in family.models:
        owner = MODELS.get(spec.name)
        if owner is not None and owner.family is not None and owner.family.name != family.name:
            raise ConfigError(f"model family {family.name}: the name {spec.name} is "
                              f"{owner.family.name}'s already")
    FAMILIES[family.name] = family
    for spec in family.models:
        object.__setattr__(spec, "family", family)
        MODELS[spec.name] = spec
    return family


def load_entry_points() -> None:
    """Register the families installed packages declare (once per process). One that fails
    to load is a one-line ConfigError naming it."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            family = point.load()
        except Exception as err:
            raise ConfigError(f"model family {point.name} ({point.value}, entry point "
                              f"{ENTRY_POINTS}): {type(err).__name__}: {err}") from None
        if not isinstance(family, Family):
            raise ConfigError(f"model family {point.name} ({point.value}): is a "
                              f"{type(family).__name__}, expected a dptrain.models.Family")
        register(family)


def get_model(name: str) -> ModelSpec:
    load_entry_points()
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; built-in: {', '.join(model_names())}, "
                          f"or PATH.py:FUNCTION for your own")
    return MODELS[name]


def model_names(kind: str | None = None) -> tuple[str, ...]:
    """Every registered model's name (of one learner kind: "tagi" or "torch")."""
    load_entry_points()
    return tuple(n for n, s in MODELS.items() if kind is None or s.kind == kind)


def kind_of(name: str) -> str | None:
    """The learner kind of a registered model ("tagi" or "torch"); None for any other name (a
    model file, whose kind is known once it is built)."""
    load_entry_points()
    spec = MODELS.get(name)
    return None if spec is None else spec.kind


def metric_extras(name: str, data: DataSpec) -> MetricExtras:
    """What model `name`'s family adds to the report on `data`; for a model file, what the
    family that takes data of its kind adds (a model file on token data is reported as a
    language model)."""
    spec = MODELS.get(name) if kind_of(name) is not None else None
    if spec is not None:
        return spec.family.extras(data)
    return next((f.extras(data) for f in FAMILIES.values()
                 if f.metrics is not None and data.kinds <= f.data), MetricExtras())


def family_blocks(name: str, model: Any) -> list | None:
    """The blocks model `name`'s family declares for parallelism to wrap (None: the family
    declares none, or `name` is a model file; the model's own `shard_units()` then)."""
    spec = MODELS.get(name) if kind_of(name) is not None else None
    if spec is None or spec.family.blocks is None:
        return None
    return list(spec.family.blocks(model))


CHECKED_OPTIONS = {"series_embedding": "series-embedding", "dropout": "dropout"}
"""Options only some models read: set for another, they are refused (by flag)."""


def check_model_options(name: str, options: ModelOptions) -> None:
    """A one-line ConfigError where `options` set what model `name` does not read, or do not
    make one of its family's models."""
    spec = get_model(name)
    for option, flag in CHECKED_OPTIONS.items():
        if getattr(options, option) and option not in spec.option_names:
            takers = [n for n, s in MODELS.items() if option in s.option_names]
            plural = "s" if len(takers) > 1 else ""
            raise ConfigError(f"{flag} is for the {' and '.join(takers)} model{plural}, not "
                              f"{name}")
    if spec.family.check_options is not None:
        spec.family.check_options(spec, options)


def check_input(name: str, input_shape: tuple[int, ...]) -> None:
    """Raise a one-line ConfigError if model `name` cannot take samples of `input_shape`."""
    spec = get_model(name)
    if spec.family is not None and spec.family.check_input is not None:
        spec.family.check_input(spec, tuple(input_shape))


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int,
                options: ModelOptions | None = None) -> Any:
    """A fresh model `name` for samples of `input_shape` with `num_outputs` outputs; seed
    torch (and `dptrain.tagi.manual_seed` for TAGI models) first for a reproducible init."""
    check_input(name, tuple(input_shape))
    return get_model(name).build(tuple(input_shape), num_outputs, options or ModelOptions())


for _family in BUILT_IN:
    register(_family)
