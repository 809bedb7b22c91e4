"""A run stands alone: trained, moved to another folder, its data and its model file deleted,
it loads, predicts, generates, exports and starts another run exactly as it did in place.

Each case trains a tiny run in-process, records what every command gives, moves the run
directory, deletes what it was trained from, and runs the commands again as a user would (a
fresh `dptrain` process, which has never imported the model file).
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dptrain
from dptrain.cli.main import main
from tests._cli import dptrain_cmd, run
from tests._images import write_digits_folder

pytestmark = pytest.mark.e2e

TEXT = "to be, or not to be: that is the question.\n" * 12
TINY = ["--no-progress", "--nproc", "1"]
MODEL_FILE = '''
from torch import nn


def net(input_shape, num_outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 8), nn.ReLU(),
                         nn.Linear(8, num_outputs))
'''


def _table(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(120, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=120)
    rows = ["a,b,c,y"] + [",".join(repr(float(v)) for v in (*xi, yi)) for xi, yi in zip(x, y)]
    path.write_text("\n".join(rows) + "\n")
    return path


def _series(path: Path) -> Path:
    rng = np.random.default_rng(0)
    days = np.datetime64("2024-01-01") + np.arange(120)
    rows = ["date,series,value,temp"]
    temp = 10 + 5 * np.sin(np.arange(120) / 9)
    for s, name in enumerate(("north", "south")):
        values = 20.0 * (s + 1) + 3 * np.sin(2 * np.pi * np.arange(120) / 7) + 0.4 * temp
        values += rng.normal(0.0, 0.3, 120)
        rows += [f"{d},{name},{v!r},{t!r}" for d, v, t in zip(days, values.tolist(),
                                                             temp.tolist())]
    path.write_text("\n".join(rows) + "\n")
    return path


def _train(out: Path, *args: str) -> Path:
    assert main(["train", *args, *TINY, "--out", str(out)]) == 0
    assert (out / "model" / "card.json").is_file()
    return out


def _cli(*args: str) -> str:
    done = run(dptrain_cmd(*args), timeout_s=240)
    assert done.returncode == 0, done.output
    return done.stdout


def _exported(run_dir: Path, out: Path) -> dict:
    _cli("export", str(run_dir), "--out", str(out))
    meta = json.loads(Path(f"{out}.json").read_text())
    return {k: meta[k] for k in ("checked", "params_sha256", "inputs", "outputs",
                                 "normalisation", "class_names", "vocabulary", "sigma_v")}


def _refused_export(run_dir: Path, out: Path) -> str:
    done = run(dptrain_cmd("export", str(run_dir), "--out", str(out)), timeout_s=240)
    assert done.returncode != 0 and len(done.stderr.splitlines()) == 1, done.output
    assert "cannot be exported yet" in done.stderr
    return done.stderr


def _outputs(run_dir: Path, work: Path, *, predict_data: str | None = None,
             prompt: str | None = None, export: bool = True) -> dict:
    """What the run's commands give: load_run's predictions on the run's kept examples, an
    export's checks and metadata, predict's table of the given data, generated text."""
    work.mkdir(parents=True, exist_ok=True)
    loaded = dptrain.load_run(run_dir)
    got: dict = {"examples": loaded.examples()}
    if prompt is None:
        got["predict"] = loaded.predict(got["examples"])
    if prompt is None and export:
        got["export"] = _exported(run_dir, work / "model.pt2")
    if predict_data is not None:
        _cli("predict", str(run_dir), "--data", predict_data, "--out", str(work / "p.csv"))
        got["table"] = (work / "p.csv").read_text()
    if prompt is not None:
        got["text"] = _cli("generate", str(run_dir), "--prompt", prompt, "--max-new-tokens",
                           "20", "--seed", "3")
    return got


def _same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        if key == "predict":
            assert torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None)
            assert a[1] is None or torch.equal(a[1], b[1])
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
        else:
            assert a == b, key


def _moved(run_dir: Path, tmp_path: Path, *gone: Path) -> Path:
    """The run moved to another folder, and what it was trained from deleted."""
    moved = tmp_path / "elsewhere" / "the-run"
    moved.parent.mkdir()
    shutil.move(run_dir, moved)
    for path in gone:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return moved


def test_a_torch_mlp_and_a_model_file_run_stand_alone(tmp_path):
    data = _table(tmp_path / "table.csv", seed=0)
    other = _table(tmp_path / "other.csv", seed=1)
    copy = tmp_path / "copy.csv"
    shutil.copy(data, copy)
    (tmp_path / "mine.py").write_text(MODEL_FILE)
    common = ["--dataset", f"csv:{data}", "--epochs", "2", "--batch-size", "32"]
    mlp = _train(tmp_path / "mlp", "--model", "torch-mlp", "--hidden", "8", *common)
    mine = _train(tmp_path / "mine", "--model", f"{tmp_path / 'mine.py'}:net", *common)
    before = {name: _outputs(run_dir, tmp_path / f"before-{name}", predict_data=f"csv:{data}")
              for name, run_dir in (("mlp", mlp), ("mine", mine))}
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for run_dir in (mlp, mine):
        shutil.move(run_dir, moved / run_dir.name)
    data.unlink()
    (tmp_path / "mine.py").unlink()
    for name in ("mlp", "mine"):
        after = _outputs(moved / name, tmp_path / f"after-{name}", predict_data=f"csv:{copy}")
        _same(before[name], after)
    said = dptrain.load_run(moved / "mine").notes
    assert said == (f"model file {tmp_path / 'mine.py'}:net: built from the run's copy "
                    f"(sha256 {said[0].split('sha256 ')[1][:12]}); {tmp_path / 'mine.py'} "
                    f"is gone",)
    # fine-tuned on other data, in the source's input space, read from its card alone
    tuned = _cli("train", "--model", "torch-mlp", "--hidden", "8", "--dataset", f"csv:{other}",
                 "--epochs", "1", "--init-from", str(moved / "mlp"), *TINY, "--out",
                 str(tmp_path / "tuned"))
    assert "init-from " in tuned
    source = dptrain.load_run(moved / "mlp").data.x_norm
    assert torch.equal(dptrain.load_run(tmp_path / "tuned").data.x_norm.mean, source.mean)


def test_a_tagi_cnn_run_stands_alone(tmp_path):
    folder = write_digits_folder(tmp_path / "digits", scale=1, per_class=6)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    run_dir = _train(tmp_path / "cnn", "--model", "tagi-cnn", "--dataset",
                     f"imagefolder:{folder}", "--image-size", "8", "--epochs", "1",
                     "--batch-size", "16")
    before = _outputs(run_dir, tmp_path / "before", predict_data=f"imagefolder:{folder}")
    moved = _moved(run_dir, tmp_path, folder)
    after = _outputs(moved, tmp_path / "after", predict_data=f"imagefolder:{copy}")
    _same(before, after)
    assert after["export"]["class_names"] == [f"digit{d}" for d in range(10)]
    tuned = _cli("train", "--model", "tagi-cnn", "--dataset", f"imagefolder:{copy}",
                 "--image-size", "8", "--epochs", "1", "--batch-size", "16", "--init-from",
                 str(moved), *TINY, "--out", str(tmp_path / "tuned"))
    assert "init-from " in tuned


def test_a_forecasting_run_with_covariates_stands_alone(tmp_path):
    data = _series(tmp_path / "load.csv")
    copy = tmp_path / "copy.csv"
    shutil.copy(data, copy)
    # windows scaled by their own level and spread: predict must scale them as training did
    run_dir = _train(tmp_path / "lstm", "--model", "tagi-lstm", "--dataset", f"series:{data}",
                     "--lookback", "8", "--covariates", "temp", "--hidden", "4",
                     "--epochs", "1", "--series-embedding", "2", "--window-scaling", "on")
    # an LSTM carries its state from call to call: it is not exported (docs/tutorials/finetune_export.md)
    before = _outputs(run_dir, tmp_path / "before", predict_data=f"series:{data}",
                      export=False)
    moved = _moved(run_dir, tmp_path, data)
    after = _outputs(moved, tmp_path / "after", predict_data=f"series:{copy}", export=False)
    _same(before, after)
    assert after["table"].startswith("series,time,origin,observed,mean,var\n")
    card = json.loads((moved / "model" / "card.json").read_text())
    rows = list(csv.DictReader(io.StringIO(after["table"])))
    rmse = math.sqrt(sum((float(r["mean"]) - float(r["observed"])) ** 2 for r in rows)
                     / len(rows))
    summary = json.loads((moved / "summary.json").read_text())
    assert rmse == pytest.approx(summary["forecast_rmse"], rel=1e-5)  # what the run reported
    assert card["decoding"]["window_scaling"] is True
    # the covariate column, then the calendar features tagi-lstm adds by default
    assert card["data"]["series"]["covariate_names"][:2] == ["temp", "weekday0"]
    assert card["data"]["series"]["names"] == ["north", "south"]


@pytest.mark.parametrize("model", ["torch-gpt", "tagi-gpt"])
def test_a_language_model_run_stands_alone(tmp_path, model):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    warmup = ["--warmup", "1"] if model == "torch-gpt" else []
    run_dir = _train(tmp_path / "gpt", "--model", model, "--dataset", f"text:{text}",
                     "--block-size", "8", "--layers", "1", "--heads", "2", "--width", "16",
                     "--batch-size", "4", "--max-steps", "4", "--val-every", "4",
                     "--val-batches", "1", *warmup)
    before = _outputs(run_dir, tmp_path / "before", prompt="to be")
    before_export = _exported(run_dir, tmp_path / "before.pt2") \
        if model == "torch-gpt" else _refused_export(run_dir, tmp_path / "before.pt2")
    moved = _moved(run_dir, tmp_path, text)
    _same(before, _outputs(moved, tmp_path / "after", prompt="to be"))
    if model == "torch-gpt":
        assert _exported(moved, tmp_path / "after.pt2") == before_export
    else:  # refused alike, in one line, from the run alone
        assert _refused_export(moved, tmp_path / "after.pt2") == \
            before_export.replace(str(run_dir), str(moved))
    other = tmp_path / "other.txt"
    other.write_text("that is the question: not to be, or to be.\n" * 12, encoding="utf-8")
    tuned = _cli("train", "--model", model, "--dataset", f"text:{other}", "--block-size", "8",
                 "--layers", "1", "--heads", "2", "--width", "16", "--batch-size", "4",
                 "--max-steps", "2", "--val-every", "2", "--val-batches", "1",
                 "--init-from", str(moved), *warmup, *TINY, "--out", str(tmp_path / "tuned"))
    assert "init-from " in tuned
    assert dptrain.load_run(tmp_path / "tuned").vocabulary == dptrain.load_run(moved).vocabulary


def test_a_run_from_before_model_cards_reads_its_data_and_says_so(tmp_path):
    data = _table(tmp_path / "table.csv", seed=0)
    run_dir = _train(tmp_path / "old", "--model", "torch-mlp", "--hidden", "8", "--dataset",
                     f"csv:{data}", "--epochs", "1")
    with_card = dptrain.load_run(run_dir)
    shutil.rmtree(run_dir / "model")  # as a run written before cards existed
    old = dptrain.load_run(run_dir)
    assert old.notes == (f"{run_dir} was written before runs kept their model card: its data "
                         f"(csv:{data}) were read again to rebuild the model",)
    x = with_card.examples()
    assert torch.equal(old.predict(x)[0], with_card.predict(x)[0])
    printed = run(dptrain_cmd("predict", str(run_dir), "--out", str(tmp_path / "p.csv")),
                  timeout_s=120)
    assert printed.returncode == 0, printed.output
    assert printed.stderr.startswith("dptrain predict: ") and "model card" in printed.stderr
    data.unlink()
    gone = run(dptrain_cmd("predict", str(run_dir), "--out", str(tmp_path / "q.csv")),
               timeout_s=120)
    assert gone.returncode != 0 and "error" in gone.stderr
