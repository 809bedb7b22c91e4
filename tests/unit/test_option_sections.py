"""`TrainOptions` in sections: each component is handed its own (`TrainOptions.sections`), the fit
section reaches the Trainer's `TrainConfig` under its own names, an option that may be unset is
None (0 from users and old files reads as None), and one count of steps per epoch."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import pytest

from dptrain.cli.main import build_parser
from dptrain.cli.train import options_from_args
from dptrain.data import steps_per_epoch
from dptrain.learners.build import RunLength, lr_schedule
from dptrain.learners.config import LearnerConfig
from dptrain.train.config import FROM_FIT, TrainConfig, saved_config
from dptrain.train.options import (
    SECTIONS,
    UNSET_AS_ZERO,
    FitOptions,
    Sections,
    TrainOptions,
    run_record,
)
from dptrain.train.resume import differences

DATA = Path(__file__).resolve().parents[1] / "data"


def _options(*argv: str) -> TrainOptions:
    return options_from_args(build_parser().parse_args(["train", *argv]))


def test_each_section_is_its_component_with_the_options_values():
    options = TrainOptions(model="torch-mlp", dataset="digits", epochs=3, batch_size=64,
                           lr=0.01, max_steps=50, nproc=1)
    sections = options.sections()
    assert [f.name for f in fields(Sections)] == list(SECTIONS)
    for name, component in SECTIONS.items():
        section = getattr(sections, name)
        assert type(section) is component
        assert all(getattr(section, f.name) == getattr(options, f.name)
                   for f in fields(component))
    assert (sections.model.model, sections.fit.epochs, sections.fit.max_steps,
            sections.learner.lr, sections.launch.nproc) == ("torch-mlp", 3, 50, 0.01, 1)


def test_the_fit_section_reaches_the_trainer_under_its_own_names():
    fit, config = {f.name: f for f in fields(FitOptions)}, {f.name: f for f in fields(TrainConfig)}
    for name in FROM_FIT:
        assert name in fit and name in config, name
        assert fit[name].default == config[name].default, name
    assert not {"num_epochs", "global_batch_size"} & set(config)


def test_train_config_takes_the_fit_section_as_it_is(tmp_path):
    from dptrain.train.job import load_job_split, train_config

    options = TrainOptions(nproc=1, epochs=3, batch_size=64, max_steps=9, val_every=3,
                           val_batches=2, checkpoint_every=4, patience=2, peak_flops=1e9,
                           keep_last=5, seed=7, out=str(tmp_path), progress=False)
    config = train_config(options, load_job_split(options))
    assert {name: getattr(config, name) for name in FROM_FIT} == \
        {name: getattr(options, name) for name in FROM_FIT}
    unset = train_config(TrainOptions(nproc=1, out=str(tmp_path)), load_job_split(options))
    assert all(getattr(unset, name) is None for name in UNSET_AS_ZERO if name in FROM_FIT)


def test_a_config_saved_before_the_renames_reads_under_todays_names():
    meta = json.loads((DATA / "run_before_validation" / "checkpoints" / "step-00000046"
                       / "meta.json").read_text())
    config = saved_config(meta["config"])
    assert (config["epochs"], config["batch_size"]) == (2, 64)
    assert "num_epochs" not in config and "global_batch_size" not in config


@pytest.mark.parametrize("name", UNSET_AS_ZERO)
def test_unset_is_none_and_zero_from_users_and_old_files_reads_as_unset(tmp_path, name):
    assert getattr(TrainOptions(), name) is None
    field = {f.name: f for f in fields(FitOptions)}[name]
    assert field.default is None and field.default_factory is MISSING
    flag = f"--{name.replace('_', '-')}"
    assert getattr(_options(flag, "0"), name) is None
    toml = tmp_path / "old.toml"
    toml.write_text(f"{name} = 0\n")
    assert getattr(_options("--config", str(toml)), name) is None
    # 0 on the command line still unsets what the file sets
    toml.write_text(f"{name} = 500\nmodel = \"torch-mlp\"\n"
                    + ("max_steps = 1000\n" if name == "lr_decay_steps" else ""))
    assert getattr(_options("--config", str(toml)), name) == 500
    assert getattr(_options("--config", str(toml), flag, "0"), name) is None
    assert getattr(TrainOptions(**{name: 0}), name) is None  # a library caller's 0 too


def test_the_help_of_an_option_that_may_be_unset_says_0_unsets_it():
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    helps = {action.dest: " ".join(action.help.split()) for action in sub._actions
             if action.help}
    for name in UNSET_AS_ZERO:
        assert "unset or 0" in helps[name] and "(default" not in helps[name], helps[name]


def test_an_options_json_written_before_none_loads_and_compares_equal():
    old = json.loads(TrainOptions().to_json())
    old.update({name: 0 for name in UNSET_AS_ZERO})
    old["peak_flops"] = 0.0
    assert TrainOptions.from_json(json.dumps(old)) == TrainOptions()
    assert TrainOptions.from_json(TrainOptions(max_steps=5).to_json()).max_steps == 5


def test_a_run_record_written_with_0_for_unset_matches_the_same_options():
    options = TrainOptions(model="torch-mlp", nproc=1)
    old = {**run_record(options), "val_batches": 0, "lr_decay_steps": 0}
    assert differences(old, run_record(options)) == []
    assert differences(old, run_record(TrainOptions(model="torch-mlp", nproc=1,
                                                    val_batches=2))) == \
        ["val-batches None -> 2"]


def test_an_old_run_whose_record_holds_0_resumes(tmp_path):
    """A checkpoint's run record from before None (val-batches 0, lr-decay-steps 0) resumes
    with the same options, which now hold None."""
    from dptrain.train.job import run_training

    options = TrainOptions(nproc=1, epochs=1, hidden=8, batch_size=256, progress=False,
                           out=str(tmp_path))
    run_training(options)
    for meta_file in (tmp_path / "checkpoints").glob("*/meta.json"):
        meta = json.loads(meta_file.read_text())
        assert meta["run_record"]["val_batches"] is None
        meta["run_record"].update(val_batches=0, lr_decay_steps=0)  # as dptrain wrote it
        meta_file.write_text(json.dumps(meta))
    summary = run_training(TrainOptions(**{**asdict(options), "epochs": 2}))
    assert summary["resumed_from"] and summary["final_epoch"] == 2


@pytest.mark.parametrize("num_train,batch_size", [(1293, 32), (60_000, 512), (100, 100),
                                                  (101, 100), (7, 8)])
def test_one_count_of_steps_per_epoch_for_the_schedule_and_the_sampler(num_train, batch_size):
    config = LearnerConfig(schedule="cosine", lr=1e-3)
    schedule = lr_schedule(config, num_train, RunLength(batch_size=batch_size, epochs=3))
    for world_size in (1, 2, 4):
        if batch_size % world_size == 0:
            per_epoch = steps_per_epoch(num_train, world_size, batch_size // world_size)
            assert schedule.total_steps == 3 * per_epoch
    assert schedule.total_steps == 3 * -(-num_train // batch_size)  # ceil, as before
