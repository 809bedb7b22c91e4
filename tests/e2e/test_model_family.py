"""A model family of a user's own package joins dptrain without a change to dptrain's code:
declared under the entry-point group `dptrain.models`, its model trains on 2 processes, resumes
bit-exactly after a kill, and loads, predicts and exports from the run alone
(docs/howto/model_family.md)."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dptrain
from dptrain.models import FAMILIES, MODELS, register
from tests._cli import base_env, dptrain_cmd, run

pytestmark = pytest.mark.e2e

FAMILY_MODULE = '''
"""A family of one torch model: a two-block residual MLP."""
import torch
from torch import nn

from dptrain.models import Family, ModelSpec


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.ReLU())

    def forward(self, x):
        return x + self.inner(x)


def residual_mlp(input_shape, num_outputs, options):
    width = options.hidden
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), width),
                         Block(width), Block(width), nn.Linear(width, num_outputs))


FAMILY = Family(
    name="residual",
    models=(ModelSpec("residual-mlp", "torch", residual_mlp, "a residual MLP of --hidden "
                      "units", defaults={"batch_size": 16}),),
    data=frozenset({"features", "images"}), options=("hidden",),
    blocks=lambda model: [m for m in model.modules() if isinstance(m, Block)])
'''


def _plugin(root: Path) -> Path:
    """A package `residual_family` that declares its family as an installed distribution
    does: a dist-info folder with entry_points.txt, found on PYTHONPATH."""
    root.mkdir()
    (root / "residual_family.py").write_text(FAMILY_MODULE)
    info = root / "residual_family-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: residual-family\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text("[dptrain.models]\n"
                                           "residual = residual_family:FAMILY\n")
    return root


def _table(path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 4))
    y = np.tanh(x @ np.array([1.0, -2.0, 0.5, 0.3])) + 0.05 * rng.normal(size=160)
    rows = ["a,b,c,d,y"] + [",".join(repr(float(v)) for v in (*xi, yi))
                            for xi, yi in zip(x, y)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_family_of_ones_own_package_trains_resumes_loads_and_exports(tmp_path):
    plugin = _plugin(tmp_path / "plugin")
    env = base_env(PYTHONPATH=str(plugin))
    data = _table(tmp_path / "table.csv")
    common = ["train", "--model", "residual-mlp", "--hidden", "8", "--dataset", f"csv:{data}",
              "--epochs", "3", "--checkpoint-every", "4", "--nproc", "2", "--no-progress"]
    clean = run(dptrain_cmd(*common, "--out", str(tmp_path / "clean")), timeout_s=240, env=env)
    assert clean.returncode == 0, clean.output
    killed = run(dptrain_cmd(*common, "--out", str(tmp_path / "killed"), "--fail-at", "1:10",
                             "--max-restarts", "1"), timeout_s=240, env=env)
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.stdout and "step-00000008" in killed.stdout
    done = json.loads((tmp_path / "clean" / "summary.json").read_text())
    again = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert done["world_size"] == 2 and done["params_sha256"] == again["params_sha256"]
    card = json.loads((tmp_path / "clean" / "model" / "card.json").read_text())
    assert card["family"] == "residual" and card["model"] == "residual-mlp"

    # from the run alone: moved, its data gone; the family comes from the package
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "clean", moved)
    copy = tmp_path / "copy.csv"
    shutil.copy(data, copy)
    data.unlink()
    predicted = run(dptrain_cmd("predict", str(moved), "--data", f"csv:{copy}", "--out",
                                str(tmp_path / "p.csv")), timeout_s=120, env=env)
    assert predicted.returncode == 0, predicted.output
    exported = run(dptrain_cmd("export", str(moved), "--out", str(tmp_path / "m.pt2")),
                   timeout_s=180, env=env)
    assert exported.returncode == 0, exported.output
    meta = json.loads((tmp_path / "m.pt2.json").read_text())
    diffs = [v for k, v in meta["checked"].items() if k.startswith("mean_max_abs_diff")]
    assert meta["model"] == "residual-mlp" and diffs and max(diffs) < 1e-5

    sys.path.insert(0, str(plugin))
    try:
        register(importlib.import_module("residual_family").FAMILY)
        loaded = dptrain.load_run(moved)
        x = loaded.examples()
        program = torch.export.load(str(tmp_path / "m.pt2")).module()
        assert torch.allclose(program(x)[0], loaded.predict(x)[0], atol=1e-5)
        assert (tmp_path / "p.csv").read_text().count("\n") == len(x) + 1
    finally:
        sys.path.remove(str(plugin))
        for name in [n for n, s in MODELS.items() if s.family.name == "residual"]:
            del MODELS[name]
        FAMILIES.pop("residual", None)
        sys.modules.pop("residual_family", None)


def test_a_family_that_takes_a_name_of_another_is_refused_in_one_line():
    from dptrain.errors import ConfigError
    from dptrain.models import Family, ModelSpec

    clash = Family(name="clash", models=(ModelSpec("tagi-mlp", "tagi", lambda *a: None, ""),),
                   data=frozenset({"features"}))
    with pytest.raises(ConfigError, match="the name tagi-mlp is mlp's already"):
        register(clash)
    with pytest.raises(ConfigError, match="data kinds"):
        register(Family(name="odd", models=(), data=frozenset({"graphs"})))
