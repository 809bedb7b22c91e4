"""Multi-node resume without a shared filesystem: two ranks, each on its own "node" (first local
rank of a node of one, with a run directory of its own), where only the rank-1 node holds the
newest checkpoint. The newest wins wherever it lies, its holder broadcasts it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dptrain import runtime as dd
from dptrain.train.job import agreed_run_dir
from dptrain.train.options import TrainOptions
from dptrain.data import ArrayDataset, Split, load_digits
from dptrain.runtime import init_distributed
from dptrain.runtime.job import stamp
from dptrain.learners.tagi_learner import TagiLearner
from tests._nets import tagi_mlp
from dptrain.tagi import manual_seed
from dptrain.train import TrainConfig, Trainer
from dptrain.train import checkpoint as ckpt
from tests._world import run_world

pytestmark = pytest.mark.dist


def _two_nodes(rank: int, world_size: int, base: str) -> dict:
    # Each rank is alone on its node: local rank 0 of 1, node rank = rank.
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    runtime = init_distributed()
    assert (runtime.env.local_rank, runtime.env.node_rank) == (0, rank)
    # Without --out or a job id, rank 0 names the run directory for everyone (the ranks' own
    # clocks differ here by a year).
    run_dir = agreed_run_dir(TrainOptions(), started_at=1.7e9 + rank * 3.2e7)
    base_dir = Path(base)
    digits = load_digits()
    small = Split(name="digits-small", task="classification", num_classes=10,
                  train=ArrayDataset(*digits.train[:320]), test=ArrayDataset(*digits.test[:64]))

    def fit(out: Path, epochs: int) -> dict:
        manual_seed(0)
        learner = TagiLearner(tagi_mlp(64, 11, hidden=16), task="classification",
                              num_classes=10)
        config = TrainConfig(out_dir=out, epochs=epochs, batch_size=64, progress=False)
        return Trainer(learner, small, config, runtime).fit()

    # The first attempt: rank 0 ran on node B, so node B's run directory has the checkpoints.
    fit(base_dir / ("nodeB" if rank == 0 else "nodeA"), 2)
    steps = ckpt.list_steps(base_dir / "nodeB" / "checkpoints")
    if rank == 0:  # node A kept only an older one (from an earlier attempt, say)
        shutil.copytree(steps[-1], base_dir / "nodeA" / "checkpoints" / steps[-1].name)
    dd.barrier()
    # The restarted job: rank 0 now on node A, the newest checkpoint only on node B (rank 1).
    resumed = fit(base_dir / ("nodeA" if rank == 0 else "nodeB"), 3)
    clean = fit(base_dir / f"clean{rank}", 3)
    return {"resumed": resumed, "clean": clean, "newest": str(steps[0]),
            "run_dir": run_dir, "node_a": [p.name for p in ckpt.list_steps(base_dir / "nodeA" / "checkpoints")]}


def test_the_newest_checkpoint_of_any_node_wins_and_its_holder_broadcasts_it(tmp_path):
    results = run_world(_two_nodes, str(tmp_path), world_size=2, init="env", timeout_s=150)
    for r in results:
        assert r["resumed"]["resumed_from"] == r["newest"]  # node B's, not node A's older one
        assert r["resumed"]["params_sha256"] == r["clean"]["params_sha256"]
        assert r["resumed"]["final_epoch"] == 3
    assert results[0]["node_a"][0] > Path(results[0]["newest"]).name  # rank 0 wrote on node A
    assert results[0]["run_dir"] == results[1]["run_dir"] == \
        f"runs/tagi-mlp-digits-{stamp(1.7e9)}"
    assert (tmp_path / "nodeA" / "epochs.csv").read_text().count("\n") == 4  # header + 3
