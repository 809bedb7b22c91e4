"""The real command line on a TAGI run that collapses (docs/design.md, contract 10): without
`--stop-on-collapse` it warns in one line, finishes, and records the collapse in summary.json;
with it, it stops with exit status 7 and that one line. The run is collapsed by construction
(tests/_collapsing_model.py: its hidden ReLUs are dead for every input from the first step), not
by a seed that happens to collapse: which seeds do depends on the CPU's float summation
order."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dptrain.learners.collapse import REMEDIES
from tests._cli import REPO, base_env, dptrain_cmd, run

pytestmark = pytest.mark.e2e

COLLAPSED_MODEL = f"{REPO / 'tests' / '_collapsing_model.py'}:dead_relus"
COLLAPSING = ("--model", COLLAPSED_MODEL, "--seed", "0", "--nproc", "1", "--no-progress")
"""A network whose hidden ReLU layer is dead for every input: collapsed at its first
evaluation on any machine."""


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("digit_files",
                                                  REPO / "bench" / "common" / "digit_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_mnist_digits(tmp_path_factory.mktemp("mnist"))


def test_a_collapse_is_one_warning_and_recorded(mnist_dir, tmp_path):
    out = tmp_path / "run"
    done = run(dptrain_cmd("train", *COLLAPSING, "--dataset", f"mnist:{mnist_dir}",
                           "--epochs", "2", "--out", str(out)), timeout_s=240, env=base_env())
    assert done.returncode == 0, done.output
    lines = [line for line in done.output.splitlines() if "collapsed at epoch" in line]
    assert len(lines) == 1 and REMEDIES in lines[0], done.output
    record = json.loads((out / "summary.json").read_text())["collapse"]
    assert record["epoch"] == 1 and record["top_class_share"] == 1.0


def test_stop_on_collapse_exits_7(mnist_dir, tmp_path):
    out = tmp_path / "run"
    done = run(dptrain_cmd("train", *COLLAPSING, "--dataset", f"mnist:{mnist_dir}",
                           "--epochs", "3", "--stop-on-collapse", "--out", str(out)),
               timeout_s=240, env=base_env())
    assert done.returncode == 7, done.output
    assert "collapsed at epoch 1" in done.output
    assert not (out / "summary.json").exists()


def test_stop_on_collapse_stops_both_ranks_of_a_two_process_run(mnist_dir, tmp_path):
    """Every rank reaches the same verdict from the same reduced sums, so all stop together
    (no rank left waiting in a collective) and the launcher prints the one line once. Each rank
    evaluates its own shard of the test set and decides from the sums reduced over both."""
    done = run(dptrain_cmd("train", "--model", COLLAPSED_MODEL, "--seed", "0", "--nproc", "2",
                           "--no-progress", "--dataset", f"mnist:{mnist_dir}", "--epochs", "3",
                           "--stop-on-collapse", "--out", str(tmp_path / "run")),
               timeout_s=240, env=base_env())
    assert done.returncode == 7, done.output
    assert done.output.count("collapsed at epoch 1") == 1, done.output
