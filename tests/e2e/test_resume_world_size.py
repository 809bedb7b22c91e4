"""`dptrain train` resumed on another world size, mid-epoch included (issue 21): the restarted job
continues at the global sample position (steps done x global batch) with its new number of
ranks, and TAGI's sum mode ends where a run that never stopped ends, up to float summation
order; average mode divides by the world size the run started on, so it does too.

One small regression job (diabetes: 353 training samples, 32 of them held out to validate,
global batch 32, so every epoch ends with a step of one sample, which on 2 ranks leaves rank 1
an empty batch) is killed mid-epoch on one
world size and finished on another. The parameters are compared with `load_run`, tensor by
tensor, relative to each tensor's largest magnitude; `epochs.csv` too (the interrupted epoch's
metric sums are carried over).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dptrain.cli.main import main
from tests._cli import dptrain_cmd, run
from tests._runs import max_relative_difference

pytestmark = pytest.mark.e2e

COMMON = ["train", "--dataset", "diabetes", "--hidden", "16", "--epochs", "2", "--batch-size",
          "32", "--val-size", "32", "--checkpoint-every", "5", "--keep-last", "10",
          "--no-progress"]


def _launch(out: Path, nproc: int, *extra: str, killed: str | None = None) -> str:
    """One attempt of the job on `nproc` processes; `killed` = RANK:STEP that dies (the job
    then fails, no restart: the next attempt is launched here on another world size). One
    process that is not killed runs in this process (cheaper)."""
    args = [*COMMON, "--nproc", str(nproc), "--out", str(out), *extra]
    if nproc == 1 and killed is None:
        assert main(args) == 0
        return ""
    result = run(dptrain_cmd(*args, *(("--fail-at", killed) if killed else ())), timeout_s=180)
    if killed:
        rank, step = killed.split(":")
        # one process runs in the launcher's own process, so the kill ends the command itself
        assert result.returncode == (-9 if nproc == 1 else 1), result.output
        assert f"[rank {rank}] fault injection (attempt 0): SIGKILL at step {step}" \
            in result.output, result.output
    else:
        assert result.returncode == 0, result.output
    return result.stdout


def _epochs(out: Path) -> list[dict[str, float]]:
    with open(out / "epochs.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _same_epochs(run_dir: Path, reference: Path, rel: float) -> None:
    ours, theirs = _epochs(run_dir), _epochs(reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [11.0, 22.0]
    for mine, want in zip(ours, theirs):
        assert mine.keys() == want.keys()
        for key, value in want.items():
            assert mine[key] == pytest.approx(value, rel=rel, abs=1e-12), (key, mine, want)


def _chain(tmp_path: Path, worlds: tuple[int, int, int], *extra: str) -> Path:
    """Killed at step 8 (mid-epoch 1; checkpoint at 5) on worlds[0] ranks, resumed on worlds[1]
    and killed at step 18 (mid-epoch 2; checkpoint at 15), finished on worlds[2]."""
    out = tmp_path / "resized"
    _launch(out, worlds[0], *extra, killed="0:8")
    second = _launch(out, worlds[1], *extra, killed=f"{worlds[1] - 1}:18")
    assert "resumed from" in second and "step-00000005 (epoch 1, step 5)" in second, second
    _launch(out, worlds[2], *extra)
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == \
        str(out / "checkpoints" / "step-00000015")
    return out


def test_sum_mode_killed_on_2_ranks_finishes_on_1_and_back_as_if_never_stopped(tmp_path):
    """float32: 2 ranks -> 1 -> 2, against a 2-rank run that never stopped: <= 1e-5."""
    _launch(tmp_path / "clean", 2)
    out = _chain(tmp_path, (2, 1, 2))
    gap = max_relative_difference(out, tmp_path / "clean")
    print(f"float32 sum mode, 2 -> 1 -> 2 ranks: max relative difference {gap:.3g}")
    assert gap <= 1e-5
    _same_epochs(out, tmp_path / "clean", rel=1e-4)


def test_sum_mode_in_float64_killed_on_1_rank_finishes_on_2_and_back(tmp_path):
    """float64: 1 rank -> 2 -> 1, against a 1-rank run that never stopped: <= 1e-10."""
    _launch(tmp_path / "clean", 1, "--precision", "64")
    out = _chain(tmp_path, (1, 2, 1), "--precision", "64")
    gap = max_relative_difference(out, tmp_path / "clean")
    print(f"float64 sum mode, 1 -> 2 -> 1 ranks: max relative difference {gap:.3g}")
    assert gap <= 1e-10
    _same_epochs(out, tmp_path / "clean", rel=1e-9)


def test_average_mode_keeps_dividing_by_the_world_size_it_started_on(tmp_path):
    """docs/tagi.md, Data-parallel TAGI: average mode's N is the run's (the world size it
    started on): started on 2 ranks, killed mid-epoch and finished on 1, each step still
    applies half the global batch's deltas with the cap of half the global batch, so the run
    ends as the 2-rank run that never stopped (1 rank's own average would apply all of it)."""
    _launch(tmp_path / "clean", 2, "--average")
    out = tmp_path / "resized"
    _launch(out, 2, "--average", killed="1:8")
    _launch(out, 1, "--average")
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == \
        str(out / "checkpoints" / "step-00000005")
    gap = max_relative_difference(out, tmp_path / "clean")
    print(f"float32 average mode, 2 -> 1 ranks: max relative difference {gap:.3g}")
    assert gap <= 1e-5
    _same_epochs(out, tmp_path / "clean", rel=1e-4)
