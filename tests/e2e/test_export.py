"""`dptrain export` with the real exporters (torch.export, ONNX) and ONNX Runtime, on tiny runs:
checked when written, `dptrain predict` on the file equals it on the run, and the refusals
(a layer that cannot export, a model file changed since training) are one line each."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from dptrain.cli.main import main
from dptrain.errors import ExportError
from dptrain.export import RunGraph, check
from dptrain.inference import load_run
from tests._cli import base_env, dptrain_cmd, run

pytestmark = pytest.mark.e2e

MODEL_FILE = '''
import torch
from torch import nn


class Branchy(nn.Module):
    """A layer whose path depends on the values of its input: no static graph has it."""

    def forward(self, x):
        return x if x.sum() > 0 else -x


def branchy(input_shape, num_outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), Branchy(), nn.Linear(8, num_outputs))
'''


def _train(out: Path, *args: str) -> None:
    assert main(["train", "--nproc", "1", "--out", str(out), "--no-progress", "--epochs", "1",
                 *args]) == 0


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    _train(root / "torch", "--model", "torch-mlp", "--hidden", "16")
    _train(root / "torch-ema", "--model", "torch-mlp", "--hidden", "16", "--ema", "0.5")
    _train(root / "tagi", "--model", "tagi-mlp", "--hidden", "16")
    _train(root / "tagi-het", "--model", "tagi-mlp", "--hidden", "8", "--dataset",
           "toy1d-hetero", "--heteroscedastic")
    return root


@pytest.mark.parametrize("run,fmt,outputs", [
    ("torch", "pt2", ["probs"]), ("torch", "onnx", ["probs"]),
    ("tagi", "onnx", ["probs", "mu", "var"]), ("tagi-het", "pt2", ["mean", "var"]),
])
def test_export_is_checked_and_predicts_as_the_run(runs, tmp_path, capsys, run, fmt, outputs):
    out = tmp_path / f"model.{fmt}"
    assert main(["export", str(runs / run), "--format", fmt, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "checked against the live model at batch sizes 1 and 7" in said
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["outputs"] == outputs and meta["format"] == fmt
    summary = json.loads((runs / run / "summary.json").read_text())
    assert meta["params_sha256"] == summary["params_sha256"]  # one epoch: best is last
    assert meta["torch_version"] == torch.__version__ and meta["input_shape"]
    if fmt == "onnx":
        assert "onnxruntime_" + outputs[-1] + "_max_abs_diff_b7" in meta["checked"]

    assert main(["predict", str(out), "--out", str(tmp_path / "exported.csv")]) == 0
    assert main(["predict", str(runs / run), "--out", str(tmp_path / "run.csv")]) == 0
    exported, live = _rows(tmp_path / "exported.csv"), _rows(tmp_path / "run.csv")
    assert len(exported) == len(live) and exported[0].keys() == live[0].keys()
    for a, b in zip(exported, live):
        if "predicted" in a:
            assert a["predicted"] == b["predicted"]
        for key in a:
            torch.testing.assert_close(float(a[key]), float(b[key]), rtol=1e-3, atol=1e-6)


def test_a_layer_that_cannot_export_and_a_changed_model_file_are_refused(tmp_path, capsys):
    model = tmp_path / "branchy.py"
    model.write_text(MODEL_FILE)
    _train(tmp_path / "run", "--model", f"{model}:branchy", "--dataset", "digits")
    capsys.readouterr()
    code = main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt2")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "layer 2 (Branchy) cannot be exported to pt2" in err
    assert not (tmp_path / "m.pt2").exists() and not list(tmp_path.glob(".m.*"))

    # the file changed: the run builds from its own copy of it, the layer is the same one
    model.write_text(MODEL_FILE.replace("nn.Linear(8, num_outputs)", "nn.Linear(8, 10)"))
    code = main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt2")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "layer 2 (Branchy) cannot be exported to pt2" in err
    # a run from before model cards has no copy: the changed file is refused
    shutil.rmtree(tmp_path / "run" / "model")
    code = main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt2")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "changed since the run was trained" in err


def test_a_sharded_fsdp_run_of_two_ranks_exports_and_starts_a_run_in_one_process(tmp_path):
    """An FSDP checkpoint written by 2 ranks is read whole in one process
    (torch.distributed.checkpoint), for export and for --init-from."""
    source = tmp_path / "fsdp"
    result = run(dptrain_cmd("train", "--model", "torch-mlp", "--hidden", "16", "--strategy",
                             "fsdp", "--nproc", "2", "--epochs", "1", "--out", str(source),
                             "--no-progress"), env=base_env(), timeout_s=240)
    assert result.returncode == 0, result.output
    assert (source / "checkpoints" / "best" / "sharded").is_dir()
    trained = json.loads((source / "summary.json").read_text())["params_sha256"]

    out = tmp_path / "model.pt2"
    assert main(["export", str(source), "--out", str(out)]) == 0
    assert json.loads(Path(f"{out}.json").read_text())["params_sha256"] == trained

    _train(tmp_path / "ft", "--model", "torch-mlp", "--hidden", "16", "--init-from",
           str(source), "--lr", "1e-4")
    meta = json.loads((tmp_path / "ft" / "checkpoints" / "best" / "meta.json").read_text())
    assert meta["run_record"]["init_from_params_sha256"] == trained


def test_an_export_that_differs_from_the_live_model_fails_naming_the_output(runs):
    """The check itself: a program whose mu is off by 1e-2, or whose classes differ, fails."""
    run = load_run(runs / "tagi")
    run.model.eval()
    graph = RunGraph(run)
    raw = run.examples()

    def off(x: torch.Tensor) -> dict[str, torch.Tensor]:
        probs, mu, var = graph(x)
        return {"probs": probs, "mu": mu + 1e-2, "var": var}

    with pytest.raises(ExportError, match=r"output mu differs from the live model at batch "
                                          r"size 1: max \|difference\| 0\.01"):
        check(off, graph, run, raw)

    def shuffled(x: torch.Tensor) -> dict[str, torch.Tensor]:
        probs, mu, var = graph(x)
        return {"probs": probs.roll(1, dims=1), "mu": mu, "var": var}

    with pytest.raises(ExportError, match=r"output probs picks load_run's class for"):
        check(shuffled, graph, run, raw)


def test_a_run_with_ema_exports_its_average_and_with_no_ema_its_live_weights(runs, tmp_path):
    summary = json.loads((runs / "torch-ema" / "summary.json").read_text())
    assert summary["ema_sha256"] != summary["params_sha256"]
    for flags, weights, digest in (([], "ema", summary["ema_sha256"]),
                                   (["--no-ema"], "live", summary["params_sha256"])):
        out = tmp_path / f"{weights}.pt2"
        assert main(["export", str(runs / "torch-ema"), "--out", str(out), *flags]) == 0
        meta = json.loads(Path(f"{out}.json").read_text())
        assert meta["weights"] == weights and meta["params_sha256"] == digest
