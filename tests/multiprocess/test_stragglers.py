"""A slow rank is named: per-rank compute, wait and data time in ranks.csv, and one warning from
rank 0 naming the rank the others wait for (dptrain.train.stragglers), on 2 real ranks."""

from __future__ import annotations

import csv
import logging
import os
import time
from pathlib import Path

import pytest

from dptrain.data import load_digits
from dptrain.runtime import init_distributed
from dptrain.learners.build import create_learner
from dptrain.learners.config import LearnerConfig, ModelConfig
from dptrain.train import TrainConfig, Trainer
from dptrain.train.stragglers import slower_than_the_others
from tests._world import run_world

DELAY_S = 0.03
"""What the slowed rank adds to each of its steps: several times a digits step here."""


def _slowed(learner, delay_s: float):
    """The test's own wrapper: `learner` whose train_step first sleeps `delay_s` (a rank on a
    slower device); nothing in dptrain knows about it."""
    step = learner.train_step

    def slow_step(batch):
        time.sleep(delay_s)
        return step(batch)

    learner.train_step = slow_step
    return learner


def _train_with_a_slow_rank(rank: int, world_size: int, model: str, out: str) -> dict:
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("dptrain.train.stragglers").addHandler(Keep(level=logging.WARNING))
    split = load_digits()
    learner = create_learner(ModelConfig(model=model, hidden=32), LearnerConfig(), split, seed=0)
    slow_rank = int(os.environ["SLOW_RANK"])
    if rank == slow_rank:
        _slowed(learner, DELAY_S)
    config = TrainConfig(out_dir=Path(out), epochs=1, batch_size=32, progress=False)
    summary = Trainer(learner, split, config, init_distributed()).fit()
    return {"warnings": warnings, "slow_ranks": summary["slow_ranks"]}


@pytest.mark.dist
@pytest.mark.parametrize("model", ["tagi-mlp", "torch-mlp"])
def test_a_rank_slowed_on_purpose_is_named_and_its_peers_wait_for_it(tmp_path, model):
    """Rank 1 sleeps 30 ms in each step. The warning names rank 1 (not rank 0) once, after
    three windows of ten steps; ranks.csv shows the sleep as rank 1's compute and as rank 0's
    wait (for torch-mlp that wait is DDP's gradient all-reduce, inside backward)."""
    results = run_world(_train_with_a_slow_rank, model, str(tmp_path), world_size=2,
                        timeout_s=150, env={"SLOW_RANK": "1"})
    assert [r["slow_ranks"] for r in results] == [[1], [1]]
    warned = results[0]["warnings"]
    assert len(warned) == 1 and warned[0].startswith("rank 1 is slow: "), warned
    assert "over the 30 steps to step 30" in warned[0], warned
    assert results[1]["warnings"] == []  # rank 0 speaks for the job
    with open(tmp_path / "ranks.csv") as f:
        rows = {int(r["rank"]): r for r in csv.DictReader(f)}
    fast, slow = ({k: float(v) for k, v in rows[r].items()} for r in (0, 1))
    assert fast["steps"] == slow["steps"] == 45 and fast["epoch"] == 1
    assert slow["compute_s"] >= DELAY_S > fast["compute_s"], rows
    # The sleep is rank 0's wait, over what rank 1 waits itself: a busy machine adds to both
    # (seen: rank 1 waiting 21 ms a step with other jobs on the 2 cores).
    assert fast["wait_s"] >= 0.6 * DELAY_S, rows
    assert fast["wait_s"] - slow["wait_s"] >= 0.4 * DELAY_S, rows


def test_the_rule_compares_each_rank_with_the_median_of_the_others():
    assert slower_than_the_others([0.010, 0.016]) == [False, True]  # 1.6x its peer
    assert slower_than_the_others([0.010, 0.014]) == [False, False]  # 1.4x
    assert slower_than_the_others([0.010, 0.011, 0.012, 0.030]) == [False] * 3 + [True]
    # two slow ranks of four: each is still 1.5x the median of its three others (0.011)
    assert slower_than_the_others([0.010, 0.011, 0.030, 0.030]) == [False, False, True, True]
    assert slower_than_the_others([0.0001, 0.0003]) == [False, False]  # below MIN_GAP_S
