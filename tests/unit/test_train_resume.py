"""One run per directory (docs/design.md, contract 8): a resume with options that change the
run is refused in one line naming them, before anything is loaded; `resume="never"` never mixes
runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dptrain.cli.main import main
from dptrain.train.options import RESUMABLE_OPTIONS, RUN_DEFAULTS, TrainOptions, run_record
from dptrain.data import load_digits
from dptrain.runtime import init_distributed
from dptrain.errors import CheckpointError
from dptrain.learners.tagi_learner import TagiLearner
from tests._nets import tagi_mlp
from dptrain.tagi import manual_seed
from dptrain.train import TrainConfig, Trainer
from dptrain.train import checkpoint as ckpt
from dptrain.train.resume import differences, partial_sums


def test_differences_name_each_option_with_both_values():
    saved = {"hidden": 128, "dataset": "digits", "lr": 0.003, "parameter_layout": "aaa"}
    now = {"hidden": 64, "dataset": "csv:my data.csv", "lr": 0.003, "parameter_layout": "bbb",
           "dropout": 0.1}
    # dropout is missing from the saved record: compared as its default
    assert differences(saved, now) == ['dataset digits -> "csv:my data.csv"',
                                       "dropout 0.0 -> 0.1", "hidden 128 -> 64"]
    assert differences({"seed": 0}, {"seed": 0, "my_option": 1}) == ["my-option (unset) -> 1"]
    # The layout is named only when no option explains it (a library user without a record).
    assert differences({"parameter_layout": "aaa"}, {"parameter_layout": "bbb"}) == \
        ["model parameters (names, shapes, dtypes) aaa -> bbb"]
    assert differences({"seed": 0, "xs": (1, 2)}, {"seed": 0, "xs": [1, 2]}) == []


def test_an_option_newer_than_the_checkpoint_matches_its_default():
    """A run saved before `lookback` existed resumes while lookback stays at its default; set
    to something else, it is another run."""
    current = run_record(TrainOptions(dataset="digits"))
    saved = {k: v for k, v in current.items() if k not in ("lookback", "horizon")}
    assert differences(saved, current) == []
    other = run_record(TrainOptions(dataset="sine", lookback=12))
    saved = {k: v for k, v in other.items() if k != "lookback"}
    assert differences(saved, other) == [f"lookback {RUN_DEFAULTS['lookback']} -> 12"]


def test_mid_epoch_metric_sums_continue_on_any_world_size():
    """Each rank's (sum, count) of the interrupted epoch: its own on the same world size (the
    epoch's sums come out bit-identical), all of them on rank 0 on another (sums are additive,
    so the epoch's metrics equal the uninterrupted run's up to summation order)."""
    saved = [{"mse": (4.0, 2.0), "error": (1.0, 2.0)}, {"mse": (6.0, 1.0), "error": (0.0, 1.0)}]
    assert [partial_sums(saved, r, 2) for r in (0, 1)] == saved
    assert partial_sums(saved, 0, 1) == {"mse": (10.0, 3.0), "error": (1.0, 3.0)}
    assert [partial_sums(saved, r, 4) for r in range(4)] == \
        [{"mse": (10.0, 3.0), "error": (1.0, 3.0)}, {}, {}, {}]
    assert partial_sums(None, 0, 2) == partial_sums([], 1, 2) == {}  # an epoch-end checkpoint


def test_the_run_record_holds_every_option_but_the_resumable_ones(tmp_path):
    record = run_record(TrainOptions(out="x", epochs=3))
    assert set(record) | RESUMABLE_OPTIONS >= {f for f in TrainOptions.__dataclass_fields__}
    assert not set(record) & RESUMABLE_OPTIONS
    assert {"model", "dataset", "batch_size", "seed", "hidden", "lr", "sigma_v", "strategy",
            "precision", "average", "accumulation_steps", "monitor"} <= set(record)


def test_a_model_file_is_identified_by_its_content(tmp_path):
    from dptrain.models.user_file import model_file_sha256

    model = tmp_path / "net.py"
    model.write_text("def build(): ...\n")
    assert model_file_sha256(f"{model}:build") == hashlib.sha256(model.read_bytes()).hexdigest()
    assert model_file_sha256("torch-mlp") is None


def _cli(out: Path, *extra: str) -> int:
    return main(["train", "--nproc", "1", "--epochs", "1", "--hidden", "16", "--batch-size", "64",
                 "--no-progress", "--out", str(out), *extra])


def test_resuming_with_other_options_is_one_line_naming_them(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(out) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert _cli(out, "--hidden", "8", "--seed", "3", "--epochs", "2") == 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"{out} was started with different options: hidden 16 -> 8, seed 0 -> 3" in err
    assert "start afresh with a new --out" in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched
    # Options that may change on resume do not count.
    assert _cli(out, "--epochs", "2", "--keep-last", "5", "--checkpoint-every", "7") == 0
    assert "resumed from" in capsys.readouterr().out


def test_resume_never_in_a_directory_with_checkpoints_refuses_and_deletes_nothing(tmp_path,
                                                                                  capsys):
    out = tmp_path / "run"
    assert _cli(out) == 0
    newest = ckpt.list_steps(out / "checkpoints")[0]
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert _cli(out, "--resume", "never", "--hidden", "8") == 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"{out} holds checkpoints (newest: {newest})" in err and "new --out" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert _cli(tmp_path / "fresh", "--resume", "never") == 0  # an empty directory is fine


def _fit(out: Path, hidden: int, **config) -> dict:
    manual_seed(0)
    learner = TagiLearner(tagi_mlp(64, 11, hidden=hidden), task="classification", num_classes=10)
    config = {"epochs": 1, "batch_size": 64, "progress": False, **config}
    return Trainer(learner, load_digits(), TrainConfig(out_dir=out, **config),
                   init_distributed()).fit()


def test_library_users_get_the_same_rule(tmp_path):
    """Trainer compares its own record (batch size, seed, parameter layout) and the caller's."""
    out = tmp_path / "lib"
    _fit(out, 16, run_record={"width": 16})
    with pytest.raises(CheckpointError, match=r"different options: width 16 -> 8 "):
        _fit(out, 8, epochs=2, run_record={"width": 8})
    with pytest.raises(CheckpointError, match=r"model parameters \(names, shapes, dtypes\)"):
        _fit(out, 8, epochs=2, run_record={"width": 16})  # the record lies; shapes do not
    with pytest.raises(CheckpointError, match=r"different options: batch-size 64 -> 32 "):
        _fit(out, 16, epochs=2, batch_size=32, run_record={"width": 16})
    meta = json.loads((ckpt.list_steps(out / "checkpoints")[0] / "meta.json").read_text())
    assert meta["run_record"]["width"] == 16
    assert _fit(out, 16, epochs=2, run_record={"width": 16})["resumed_from"]
