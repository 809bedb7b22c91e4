"""`dptrain train --init-from`: a trained run starts another (fine-tuning, a new head, frozen
layers; TAGI: the posterior becomes the prior), and the bad inputs are one line each.

The runs are in-process `dptrain train --nproc 1` on tiny models (a second or two each).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dptrain.cli.main import main
from dptrain.runtime import Runtime
from dptrain.runtime.env import SINGLE
from dptrain.inference import load_run, raw_inputs
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.train import checkpoint as ckpt
from dptrain.train import init_from
from dptrain.train.job import learner_model, load_job_split
from dptrain.train.options import TrainOptions

pytestmark = pytest.mark.e2e

DIGITS3 = '''
"""Digits 0, 1 and 2 only, 24 training samples: a small 3-class task in digits' pixel space,
with a normalisation of its own (which a run started from digits replaces)."""
import torch
from sklearn.datasets import load_digits
from dptrain.data.datasets.base import Normalisation, classification_split


def digits3():
    bunch = load_digits()
    keep = bunch.target < 3
    x = torch.from_numpy(bunch.data[keep]).float()
    y = torch.from_numpy(bunch.target[keep]).long()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    train, test = slice(0, 24), slice(200, None)
    norm = Normalisation(x[train].mean(0), torch.tensor(8.0))
    return classification_split("digits3", x[train], y[train], x[test], y[test], 3, norm)
'''


def _train(out: Path, *args: str) -> int:
    return main(["train", "--nproc", "1", "--out", str(out), "--no-progress", *args])


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _last_weights(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.find(run, "last").load_state()["learner"]["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A torch-mlp and a tagi-mlp trained one epoch on digits, and the 3-class data file."""
    root = tmp_path_factory.mktemp("init-from")
    (root / "digits3.py").write_text(DIGITS3)
    assert _train(root / "torch-src", "--model", "torch-mlp", "--hidden", "32",
                  "--epochs", "1") == 0
    assert _train(root / "tagi-src", "--model", "tagi-mlp", "--hidden", "16",
                  "--epochs", "1") == 0
    return root


def test_torch_ten_to_three_classes_keeps_the_backbone_and_a_new_head(runs, capsys):
    """10-class -> 3-class: every backbone tensor starts (and, frozen, stays) equal to the
    source's, the head is re-initialised and named; the source joins the record; the run keeps
    digits' input normalisation; and it beats the same run from scratch after the same steps."""
    source, out, scratch = runs / "torch-src", runs / "torch-ft", runs / "torch-scratch"
    data = f"{runs / 'digits3.py'}:digits3"
    common = ["--model", "torch-mlp", "--hidden", "32", "--dataset", data, "--epochs", "1",
              "--batch-size", "8"]
    capsys.readouterr()
    assert _train(out, *common, "--init-from", f"{source}:last", "--freeze", "1,3") == 0
    said = capsys.readouterr().out
    assert "re-initialised 5.weight (10, 32) -> (3, 32), 5.bias (10,) -> (3,)" in said
    assert "frozen 4 parameter tensor(s) under 1,3" in said

    # Before any step: what the CLI builds, built again here.
    options = TrainOptions(model="torch-mlp", hidden=32, dataset=data, init_from=str(source))
    src = init_from.resolve(str(source))
    learner = create_learner(options.part(ModelConfig), options.part(LearnerConfig),
                             init_from.source_space(load_job_split(options), src), seed=0)
    init_from.initialise(*learner_model(learner), src, options.part(init_from.InitOptions))
    start, saved = learner.module.state_dict(), _last_weights(source)
    for name in ("1.weight", "1.bias", "3.weight", "3.bias"):
        assert torch.equal(start[name], saved[name]), name
    assert start["5.weight"].shape == (3, 32)

    # After training: the frozen backbone is still the source's, the head has moved.
    trained = _last_weights(out)
    for name in ("1.weight", "1.bias", "3.weight", "3.bias"):
        assert torch.equal(trained[name], saved[name]), name
    assert not torch.equal(trained["5.weight"], start["5.weight"])

    meta = ckpt.find(out, "last").meta
    assert meta["run_record"]["init_from_params_sha256"] == _summary(source)["params_sha256"]
    assert meta["run_record"]["init_from_checkpoint"].startswith(str(source))
    assert meta["config"]["record"]["init_from"] == f"{source}:last"
    run, src_run = load_run(out), load_run(source)
    assert torch.equal(run.x_norm.mean, src_run.x_norm.mean)
    assert torch.equal(run.x_norm.std, src_run.x_norm.std)

    assert _train(scratch, *common) == 0
    assert _summary(out)["test_error"] < _summary(scratch)["test_error"] - 0.05, \
        (_summary(out)["test_error"], _summary(scratch)["test_error"])


def test_init_partial_loads_what_matches(runs, capsys):
    """Dropout layers renumber the later layers: --init-partial loads the first layer only."""
    out = runs / "torch-partial"
    assert _train(out, "--model", "torch-mlp", "--hidden", "32", "--dropout", "0.1",
                  "--epochs", "1", "--init-from", str(runs / "torch-src"), "--init-partial",
                  "--freeze", "1") == 0
    assert torch.equal(_last_weights(out)["1.weight"], _last_weights(runs / "torch-src")
                       ["1.weight"])


def test_tagi_init_from_first_evaluation_equals_the_source(runs):
    """TAGI: the source's posterior is the new run's prior, so before any step the new run's
    predictions are the source's, exactly."""
    source = runs / "tagi-src"
    options = TrainOptions(model="tagi-mlp", hidden=16, init_from=str(source), sigma_v=0.3)
    src = init_from.resolve(str(source))
    split = init_from.source_space(load_job_split(options), src)
    learner = create_learner(options.part(ModelConfig), options.part(LearnerConfig), split,
                             seed=5)
    init_from.initialise(*learner_model(learner), src, options.part(init_from.InitOptions))
    learner.setup(Runtime(SINGLE, None, torch.device("cpu"), timedelta(seconds=60)))
    x = split.test.x
    learner.net.eval()
    mu, var = learner.net(x)
    reference = load_run(source)
    assert torch.equal(split.test.x, reference.load_data().test.x)
    ref_mu, ref_var = reference.model(x)
    assert torch.equal(mu, ref_mu) and torch.equal(var, ref_var)
    # the command line trains on from it (continual learning, docs/tutorials/finetune_export.md)
    out = runs / "tagi-ft"
    assert _train(out, "--model", "tagi-mlp", "--hidden", "16", "--epochs", "1",
                  "--init-from", str(source), "--sigma-v", "0.1") == 0
    record = ckpt.find(out, "last").meta["run_record"]
    assert record["init_from_params_sha256"] == _summary(source)["params_sha256"]
    assert _summary(out)["test_error"] <= _summary(source)["test_error"] + 0.02
    # and what `load_run` predicts from raw inputs (normalised again: float rounding only)
    probs, _ = reference.predict(raw_inputs(reference.load_data().test, reference.x_norm))
    torch.testing.assert_close(learner.hrc.probabilities(mu, var), probs, rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("args,expected", [
    (["--init-from", "{runs}"], "is neither a run directory (no checkpoints/ in it) nor a "
                                "checkpoint directory"),
    (["--model", "tagi-mlp", "--init-from", "{runs}/torch-src"],
     "a torch checkpoint (torch-mlp); this run's model is a tagi model"),
    (["--model", "torch-mlp", "--hidden", "32", "--init-from", "{runs}/torch-src",
      "--freeze", "1,layer9"], "--freeze layer9: matches no parameter of this model; its "
                               "parameters are under 1, 3, 5"),
    (["--model", "torch-mlp", "--hidden", "32", "--dropout", "0.1", "--init-from",
      "{runs}/torch-src"], "this model's 4.weight, 4.bias, 7.weight, 7.bias not in the source; "
                           "the source's 3.weight, 3.bias, 5.weight, 5.bias not in this model"),
    (["--model", "tagi-mlp", "--freeze", "0"], "--freeze is for torch models"),
])
def test_bad_init_inputs_are_one_line(runs, tmp_path, capsys, args, expected):
    code = _train(tmp_path / "out", "--epochs", "1", *[a.format(runs=runs) for a in args])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "checkpoints").exists()
