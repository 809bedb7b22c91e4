"""Data for data-parallel training: each rank's share of the samples, and the datasets.

    import torch
    from dptrain.data import ShardedSampler, load_dataset

    split = load_dataset("digits")                 # 1437 train / 360 test, inputs (64,)
    sampler = ShardedSampler(split.train, rank=0, world_size=2, seed=0)  # defaults: the group
    for epoch in range(2):
        sampler.set_epoch(epoch)                    # a new permutation, the same on every rank
        for idx in sampler.batches(32):             # (32,) int64 indices, last batch shorter
            x, y = split.train[idx]                 # (B, 64) float32, (B,) int64
    state = sampler.state_dict()                    # epoch, seed, position: exact resume

    loader = torch.utils.data.DataLoader(split.train, batch_size=32, sampler=sampler)

Train mode pads by wrapping so every rank takes the same number of steps; eval mode
(`mode="eval"`) visits every sample exactly once over all ranks.
"""

from dptrain.data.datasets import (
    ArrayDataset,
    Normalisation,
    Split,
    accepted_names,
    load_cifar10,
    load_csv,
    load_dataset,
    load_diabetes,
    load_digits,
    load_mnist,
    load_npz,
    load_toy1d,
    load_toy1d_hetero,
    read_cifar_binary,
    read_cifar_pickle,
    read_csv,
    read_idx,
)
from dptrain.data.sampler import (
    ShardedSampler,
    num_samples_per_rank,
    steps_per_epoch,
    world_sizes_dividing,
)

__all__ = [
    "ArrayDataset", "Normalisation", "ShardedSampler", "Split", "accepted_names", "load_cifar10",
    "load_csv", "load_dataset", "load_diabetes", "load_digits", "load_mnist", "load_npz",
    "load_toy1d", "load_toy1d_hetero", "num_samples_per_rank", "read_cifar_binary", "read_cifar_pickle", "read_csv",
    "read_idx", "steps_per_epoch", "world_sizes_dividing",
]
