"""Validation chooses, test reports (contract 11): every dataset gets a validation part, a run
evaluates it each epoch as val_* metrics and monitors it by default; --val-size and --test-size
size the parts, bad sizes are one line; a run written before validation parts resumes as it
began."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from dptrain.cli.main import build_parser, main
from dptrain.cli.train import options_from_args
from dptrain.data import load_dataset
from dptrain.data.config import DataConfig, load_split
from dptrain.data.datasets.sizes import parse_size
from dptrain.errors import ConfigError, DataError
from tests._images import write_digits_folder

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("text, parsed", [("auto", None), (None, None), ("24", 24), (" 7 ", 7),
                                          ("0.1", 0.1), (".25", 0.25), (3, 3), (0.5, 0.5)])
def test_a_size_is_a_count_or_a_fraction(text, parsed):
    assert parse_size(text, option="val-size") == parsed


def test_series_parts_are_sized_in_time_steps_or_fractions():
    sine = load_split(DataConfig(dataset="sine"), seed=0).series  # 1156 steps: 70/10/20 %
    assert (sine.train_end, sine.val_end) == (809, 924)
    sized = load_split(DataConfig(dataset="sine", test_size="100", val_size="50"), seed=0)
    assert (sized.series.train_end, sized.series.val_end) == (1006, 1056)
    assert sized.validation.start.min() == 1006 and sized.test.start.min() == 1056
    fractions = load_split(DataConfig(dataset="sine", test_size="0.25", val_size="0.05"),
                           seed=0).series
    assert (fractions.train_end, fractions.val_end) == (810, 867)  # 1156 - 289 - 57


@pytest.mark.parametrize("options, error, message", [
    ({"dataset": "sine", "test_size": "2000"}, DataError,
     "sine: --test-size 2000 (2000) and --val-size auto (115) take 2115 time steps, but the "
     "series has 1156: nothing is left to train on"),
    ({"dataset": "sine", "test_size": "1156"}, DataError, "nothing is left to train on"),
    ({"dataset": "sine", "test_size": "0"}, ConfigError,
     "--test-size: expected a count (an integer >= 1), a fraction strictly between 0 and 1 "
     "(such as 0.1) or auto, got '0'"),
    ({"dataset": "sine", "test_size": "-5"}, ConfigError, "--test-size: expected a count"),
    ({"dataset": "sine", "val_size": "1.0"}, ConfigError, "--val-size: expected a count"),
    ({"dataset": "sine", "val_size": "1.5"}, ConfigError, "got '1.5'"),
    ({"dataset": "sine", "val_size": "ten"}, ConfigError, "got 'ten'"),
    ({"dataset": "sine", "val_size": "0.0001"}, DataError,
     "sine: --val-size 0.0001 is 0 of its 1156 time steps; a part needs at least one"),
    ({"dataset": "sine", "lookback": 24, "test_size": "0.99"}, DataError,
     "nothing is left to train on"),
    ({"dataset": "digits", "val_size": "1437"}, ConfigError,
     "--val-size 1437: the training part of digits has 1437 samples, and holding out 1437 "
     "leaves none to train on"),
    ({"dataset": "digits", "val_size": "0"}, ConfigError, "--val-size: expected a count"),
    ({"dataset": "digits", "test_size": "100"}, ConfigError,
     "test-size: for time series (sine, seasonal, hourly, series); digits is not one"),
])
def test_bad_sizes_are_one_line_saying_what_and_where(options, error, message):
    with pytest.raises(error) as caught:
        load_split(DataConfig(**options), seed=0)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_data_without_a_validation_part_holds_one_out_by_a_seeded_draw():
    whole = load_dataset("digits")
    split = load_split(DataConfig(), seed=0)  # auto: 0.1 of the 1437 training samples
    assert (len(split.train), len(split.validation), len(split.test)) == (1293, 144, 360)
    assert torch.equal(split.test.x, whole.test.x), "the test part is never touched"
    rows = lambda x: sorted(map(tuple, x.tolist()))  # noqa: E731
    assert rows(torch.cat([split.train.x, split.validation.x])) == rows(whole.train.x)
    again = load_split(DataConfig(), seed=0)
    assert torch.equal(again.validation.x, split.validation.x), "the draw is seeded"
    other = load_split(DataConfig(), seed=1)
    assert not torch.equal(other.validation.x, split.validation.x)
    counted = load_split(DataConfig(val_size="100"), seed=0)
    assert (len(counted.train), len(counted.validation)) == (1337, 100)


def test_an_image_folder_validates_on_val_beside_test_else_holds_out_of_train(tmp_path):
    folder = write_digits_folder(tmp_path / "f", per_class=4)
    only_val = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=8,
                                     val_size="10"), seed=0)
    assert (len(only_val.train), len(only_val.validation), len(only_val.test)) == (30, 10, 40)
    assert only_val.test.files.root.name == "val", "with train/ and val/ only, val/ tests"
    shutil.copytree(folder / "val", folder / "test")
    (next((folder / "test" / "digit0").iterdir())).unlink()
    both = load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=8), seed=0)
    assert both.validation.files.root.name == "val" and both.test.files.root.name == "test"
    assert (len(both.train), len(both.validation), len(both.test)) == (40, 40, 39)
    assert both.train.transform.train, "training images are still augmented"
    with pytest.raises(ConfigError, match=r"--val-size 10: imagefolder:.* has a validation "
                                          r"part of its own \(40 samples\)"):
        load_split(DataConfig(dataset=f"imagefolder:{folder}", image_size=8, val_size="10"),
                   seed=0)


USER_DATA = '''
import torch
from sklearn.datasets import load_digits
from dptrain.data import ArrayDataset, Split

def _parts():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    return ArrayDataset(x[:1200], y[:1200]), ArrayDataset(x[1200:1500], y[1200:1500]), \\
        ArrayDataset(x[1500:], y[1500:])

def own():
    train, val, test = _parts()
    return Split(name="own", task="classification", num_classes=10, train=train,
                 validation=val, test=test)

def contrary():
    """A validation part whose labels all disagree with the truth: the better the model, the
    worse its validation error, while the test error keeps falling."""
    train, val, test = _parts()
    return Split(name="contrary", task="classification", num_classes=10, train=train,
                 validation=ArrayDataset(val.x, (val.y + 1) % 10), test=test)

def none():
    train, _, test = _parts()
    return Split(name="none", task="classification", num_classes=10, train=train, test=test)
'''


@pytest.fixture
def user_data(tmp_path) -> Path:
    path = tmp_path / "my_data.py"
    path.write_text(USER_DATA)
    return path


def test_your_own_dataset_brings_its_validation_part_or_has_one_held_out(user_data):
    own = load_split(DataConfig(dataset=f"{user_data}:own"), seed=0)
    assert (len(own.train), len(own.validation), len(own.test)) == (1200, 300, 297)
    held = load_split(DataConfig(dataset=f"{user_data}:none", val_size="0.25"), seed=0)
    assert (len(held.train), len(held.validation), len(held.test)) == (900, 300, 297)


def _columns(run: Path) -> list[dict[str, str]]:
    with open(run / "epochs.csv") as f:
        return list(csv.DictReader(f))


def test_best_follows_the_validation_metric_while_the_test_metric_is_reported(user_data,
                                                                              tmp_path, capsys):
    """Contract 11 on a classifier: best/ and best_epoch are the epoch of the lowest val_error,
    here (a validation part that disagrees with the truth) the epoch the test error is worst,
    and the test metrics are still in epochs.csv, summary.json and the final line."""
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--dataset", f"{user_data}:contrary", "--hidden", "16",
                 "--epochs", "3", "--batch-size", "64", "--no-progress", "--out", str(out)]) == 0
    rows = _columns(out)
    val = [float(r["val_error"]) for r in rows]
    test = [float(r["test_error"]) for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    best = val.index(min(val)) + 1
    assert summary["monitor"] == "val_error" and summary["best_epoch"] == best
    assert summary["best_val_error"] == min(val)
    assert test[best - 1] > min(test), f"validation and test should disagree here: {rows}"
    assert summary["test_error"] == test[-1] and summary["val_error"] == val[-1]
    best_meta = json.loads((out / "checkpoints" / "best" / "meta.json").read_text())
    assert best_meta["step"] == int(rows[best - 1]["step"])
    final = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert f"best/ epoch {best} by val_error {min(val):.4g}" in final[0], final


def test_no_validation_part_is_not_an_option_and_a_test_monitor_is_refused(capsys):
    with pytest.raises(ConfigError, match=r"^--val-size none: no validation part would leave "
                                          r"the test part to choose the best epoch"):
        options_from_args(build_parser().parse_args(["train", "--val-size", "none"]))
    assert main(["train", "--nproc", "1", "--monitor", "test_error", "--epochs", "1"]) != 0
    assert "--monitor test_error: the test part is evaluated and reported, never used to " \
           "choose" in capsys.readouterr().err


@pytest.mark.recorded
def test_a_run_written_before_validation_parts_resumes_as_it_began(tmp_path, capsys):
    """tests/data/run_before_validation: `dptrain train --nproc 1 --epochs 2 --hidden 8
    --batch-size 64 --keep-last 1` run by the dptrain before this change (its epochs.csv and
    newest checkpoint; the record lacks val_size). Resumed by today's command with no new
    option, it goes on with no validation part (all 1437 training samples, 23 steps an epoch,
    no val_* column), monitors test_error and decodes with pytagi's probit link as it did;
    resumed again, the same. Portable (docs/design.md, contract 12): the recorded epochs are
    kept as text, not recomputed, and no figure computed here is compared with one recorded
    elsewhere."""
    run = Path(shutil.copytree(DATA / "run_before_validation", tmp_path / "run"))
    before = (run / "epochs.csv").read_text()
    args = ["train", "--nproc", "1", "--hidden", "8", "--batch-size", "64", "--keep-last", "1",
            "--no-progress", "--out", str(run)]
    assert main([*args, "--epochs", "3"]) == 0
    after = (run / "epochs.csv").read_text()
    assert after.startswith(before), "the epochs already run are kept byte for byte"
    rows = _columns(run)
    assert [int(r["step"]) for r in rows] == [23, 46, 69]
    assert list(rows[0]) == before.splitlines()[0].split(","), "no val_* column"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["monitor"] == "test_error" and summary["resumed_from"]
    assert summary["hrc_link"] == "probit", "from before the link choice: pytagi's link"
    for meta in run.glob("checkpoints/*/meta.json"):  # the record: fixed, not chosen
        assert json.loads(meta.read_text())["run_record"]["hrc_link"] == "probit", meta
    assert summary["best_test_error"] == min(float(r["test_error"]) for r in rows)
    out = capsys.readouterr().out
    assert "by test_error" in out and "validation" not in out.split("dptrain train:")[1][:300]
    assert main([*args, "--epochs", "4"]) == 0, "its own new checkpoints resume the same way"
    assert [int(r["step"]) for r in _columns(run)] == [23, 46, 69, 92]
    assert main([*args, "--epochs", "5", "--val-size", "0.2"]) != 0
    assert "val-size none -> 0.2" in capsys.readouterr().err



def test_sizes_come_from_flags_or_toml_and_are_checked_before_anything_runs(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("dataset = 'sine'\nval_size = 0.05\ntest_size = 168\n")
    options = options_from_args(build_parser().parse_args(["train", "--config", str(config)]))
    assert (options.val_size, options.test_size) == ("0.05", "168")
    flags = options_from_args(build_parser().parse_args(["train", "--val-size", "300"]))
    assert flags.val_size == "300"
    with pytest.raises(ConfigError, match=r"^--test-size: expected a count .* got '-1'$"):
        options_from_args(build_parser().parse_args(["train", "--test-size", "-1"]))
