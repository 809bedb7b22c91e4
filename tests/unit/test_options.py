"""Options are declared once, on their fields (docs/design.md, Options): the flags, their help,
the TOML keys and the run record all come from there."""

from __future__ import annotations

from dataclasses import fields

import pytest

from dptrain.cli.main import build_parser
from dptrain.cli.train import accepted_keys
from dptrain.data import accepted_names
from dptrain.errors import ConfigError
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.models import MODELS
from dptrain.options import field_docs, flag
from dptrain.train.options import COMPONENTS, RESUMABLE_OPTIONS, TrainOptions


def _train_help() -> str:
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    return sub.format_help()


def test_every_option_has_a_doc_a_flag_and_a_toml_key():
    docs = field_docs(TrainOptions)
    text = " ".join(_train_help().split())
    for f in fields(TrainOptions):
        assert docs.get(f.name), f"{f.name} has no docstring: its flag would have no help"
        switch = f"--{f.metadata.get('negative') or flag(f.name)}"
        assert switch in text, f"no flag {switch} for {f.name}"
        assert " ".join(docs[f.name].split())[:40] in text, f"help of {f.name} is not its doc"
    assert sorted(accepted_keys()) == sorted(f.name for f in fields(TrainOptions))


def test_train_options_is_exactly_the_union_of_the_components():
    names = [f.name for c in COMPONENTS for f in fields(c)]
    assert len(names) == len(set(names)), "two components declare the same option"
    assert set(names) == {f.name for f in fields(TrainOptions)}


def test_the_docs_name_every_model_and_dataset():
    model_doc = field_docs(ModelConfig)["model"]
    assert all(name in model_doc for name in MODELS)
    dataset_doc = field_docs(TrainOptions)["dataset"]
    assert all(name.split(":")[0] in dataset_doc for name in accepted_names()
               if not name.startswith("PATH"))


def test_each_component_validates_its_own_fields():
    with pytest.raises(ConfigError, match="precision: expected one of 32, 64, bf16, fp16"):
        ModelConfig(precision="16")
    with pytest.raises(ConfigError, match="sigma-v-min must be >= 0"):
        LearnerConfig(sigma_v_min=-1.0)
    with pytest.raises(ConfigError, match="lr: expected a learning rate > 0, got 0.0"):
        TrainOptions(lr=0.0)  # the union runs each component's checks


def test_what_may_change_on_resume_is_declared_on_the_fields():
    assert {"epochs", "patience", "out", "nproc", "threads", "timeout"} <= RESUMABLE_OPTIONS
    assert not {"model", "batch_size", "seed", "lr", "sigma_v", "dataset"} & RESUMABLE_OPTIONS
