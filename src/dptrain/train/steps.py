"""Steps as the run's clock: which validation samples a step-counted run looks at and how many
samples it has seen at a step.

    validation_indices(len(split.validation), batches=20, batch_size=64, seed=0)
    samples_seen(130, steps_per_epoch=40, global_batch_size=25, num_samples=1000)  # 3250

A run's validation points, its length and its schedule are functions of the global step (the
optimizer steps of all ranks together), never of the world size: the validation samples are a
seeded choice over the whole validation part, made the same on every rank and world size, and
the samples seen at a step count the epoch's permutation positions consumed, which a sampler
restored on another world size continues (`ShardedSampler.load_state_dict`): every epoch has
ceil(samples / global batch) steps.
"""

from __future__ import annotations


import torch

VALIDATION_SEED_OFFSET = 7_919
"""Added to the run's seed for the choice of validation samples, so that it is not the first
epoch's training permutation (an unrelated stream, fixed for the run)."""


def validation_indices(num_samples: int, *, batches: int, batch_size: int, seed: int
                       ) -> torch.Tensor | None:
    """The validation samples of `batches` global batches of `batch_size`: a seeded choice
    spread over the whole part (its windows would otherwise all come from its beginning),
    sorted; None when they cover the whole part (then all of it is evaluated)."""
    count = batches * batch_size
    if count >= num_samples:
        return None
    generator = torch.Generator().manual_seed(seed + VALIDATION_SEED_OFFSET)
    return torch.randperm(num_samples, generator=generator)[:count].sort().values


def samples_seen(step: int, *, steps_per_epoch: int, global_batch_size: int,
                 num_samples: int) -> int:
    """Training samples seen after global step `step`: every epoch has `steps_per_epoch` steps
    of `global_batch_size`, its last one short (the wrap-around padding of equal shards not
    counted), so the same number at the same step on any world size."""
    epochs, within = divmod(step, steps_per_epoch)
    return epochs * num_samples + min(within * global_batch_size, num_samples)


