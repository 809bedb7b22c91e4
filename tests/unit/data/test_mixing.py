"""Mixup and cutmix over the global batch (docs/reference/gradient_learner.md, Optimizers and schedules):
each sample's partner and weight come from (seed, epoch, global position), so the mixed
batches of 2 ranks, interleaved, are those of 1 process; mixup and cutmix are their formulas."""

from __future__ import annotations

import torch

from dptrain.cli.main import main
from dptrain.data import ShardedSampler
from dptrain.data.datasets.base import ArrayDataset
from dptrain.data.loader import BatchLoader
from dptrain.data.mixing import Mixing

N, B, K = 40, 8, 5


def _data() -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    return ArrayDataset(torch.rand(N, 1, 6, 6, generator=g), torch.randint(0, K, (N,),
                                                                            generator=g))


def _epoch(mixing: Mixing, rank: int, world: int, epoch: int = 1) -> list[tuple]:
    data = _data()
    sampler = ShardedSampler(data, rank=rank, world_size=world, seed=3)
    sampler.set_epoch(epoch)
    return list(BatchLoader(data, sampler, B // world, mixing=mixing))


def test_the_mixed_batches_do_not_depend_on_the_world_size():
    mixing = Mixing(mixup=0.4, cutmix=1.0, num_classes=K, seed=7)
    one = _epoch(mixing, 0, 1)
    two = [_epoch(mixing, r, 2) for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) == N // B
    for step, (x, y) in enumerate(one):
        for rank in range(2):
            xr, yr = two[rank][step]
            assert torch.equal(xr, x[rank::2]) and torch.equal(yr, y[rank::2]), (step, rank)
    assert not torch.equal(one[0][0], _epoch(mixing, 0, 1, epoch=2)[0][0])  # a new epoch


def test_mixup_and_cutmix_follow_their_formulas():
    data = _data()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(B)
    x, y = data[order[:B]]
    mixup = Mixing(mixup=0.4, num_classes=K)
    plan = mixup.plan(0, positions, order, B, (1, 6, 6))
    assert set(plan.partners.tolist()) <= set(order[:B].tolist())  # from the same global batch
    assert not torch.equal(plan.partners, order[:B])  # never itself
    xp, yp = data[plan.partners]
    mixed, targets = mixup.apply(plan, (x, y), (xp, yp))
    lam = plan.lam.float()
    torch.testing.assert_close(mixed, lam.view(-1, 1, 1, 1) * x + (1 - lam.view(-1, 1, 1, 1)) * xp)
    torch.testing.assert_close(targets.sum(1), torch.ones(B))
    for i in range(B):
        assert targets[i, y[i]] >= lam[i] - 1e-6 and targets[i, yp[i]] >= 1 - lam[i] - 1e-6

    cutmix = Mixing(cutmix=1.0, num_classes=K)
    plan = cutmix.plan(0, positions, order, B, (1, 6, 6))
    xp, yp = data[plan.partners]
    mixed, targets = cutmix.apply(plan, (x, y), (xp, yp))
    for i, (y0, y1, x0, x1) in enumerate(plan.boxes.tolist()):
        inside = torch.zeros(6, 6, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert torch.equal(mixed[i, :, inside], xp[i, :, inside])
        assert torch.equal(mixed[i, :, ~inside], x[i, :, ~inside])
        assert abs(plan.lam[i].item() - (1 - inside.sum().item() / 36)) < 1e-12  # share kept


def test_a_run_trains_with_mixup_and_cutmix(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--model", "torch-cnn", "--dataset", "digits-image",
                 "--epochs", "1", "--batch-size", "128", "--mixup", "0.2", "--cutmix", "1.0",
                 "--label-smoothing", "0.1", "--no-progress", "--out", str(out)]) == 0
    assert (out / "summary.json").is_file()
