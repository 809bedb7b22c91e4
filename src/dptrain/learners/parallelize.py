"""A torch model made data-parallel from outside: the wrappers `TorchLearner.setup` applies.

    from dptrain.learners.parallelize import model_blocks, parallelize

    done = parallelize(model, blocks=model_blocks(model), strategy="fsdp", compile=True,
                       activation_checkpointing=True, device=device, distributed=True)
    done.forward(x)   # the training forward: compiled, through FSDP's hooks or DDP's wrapper
    done.module       # the model itself (evaluation, state dicts); done.wrapped: DDP's wrapper

The model holds none of this. It only says which submodules are its blocks, the repeated units
that are checkpointed and sharded one by one, with a `shard_units()` method (`GPT` in
`dptrain.models.gpt` returns its transformer blocks; a model of your own may declare its
blocks the same way). `parallelize` applies, in torchtitan's order:

1. global-batch BatchNorm (`sync_batchnorm`, more than one rank): `convert_sync_batchnorm`;
2. activation checkpointing: each block replaced in its parent by torch's `checkpoint_wrapper`
   (non-reentrant `torch.utils.checkpoint` in training, RNG state kept, so dropout draws the
   same masks when the block is recomputed in the backward); state dicts keep the model's own
   names (the wrapper's prefix is dropped; `plain_name` drops it from `named_parameters`);
3. `torch.compile` of the training forward (lazy: traced at the first step, of the model as
   it is by then);
4. FSDP2: `fully_shard` on each block, then on the root, which keeps what no block holds (a
   GPT's embeddings and the output layer tied to them); without declared blocks each child
   with parameters is a unit. Or DDP: a wrapper rather than a change in place, so what is
   compiled is the wrapper (dynamo then splits the graph at DDP's gradient buckets, and each
   bucket's all-reduce overlaps the backward of the next; `TorchLearnerConfig.compile`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from dptrain.errors import ConfigError
from dptrain.learners.batchnorm import AllReduceBatchNorm, convert_sync_batchnorm
from dptrain.runtime import broadcast_tensors, get_world_size

GLOBAL_BATCHNORMS = (nn.SyncBatchNorm, AllReduceBatchNorm)
"""BatchNorms whose statistics are the global batch's: equal on every rank by construction."""
# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns).
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False})


@dataclass(frozen=True)
class Parallelized:
    """What `parallelize` made of a model."""

    module: nn.Module
    """The model: on its device, BatchNorm converted, blocks checkpointed, FSDP-sharded in
    place; never DDP's wrapper. Evaluation and state dicts use it."""
    wrapped: nn.Module
    """DDP's wrapper (gradient all-reduce, `no_sync`), else the module itself."""
    forward: Callable[[torch.Tensor], Any]
    """The training forward: `torch.compile` of what trains (`compile`), else `wrapped`."""


def model_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The blocks `model` declares with `shard_units()`; None when it declares none."""
    declare = getattr(model, "shard_units", None)
    return list(declare()) if callable(declare) else None


def parallelize(model: nn.Module, *, blocks: Sequence[nn.Module] | None, strategy: str,
                compile: bool, activation_checkpointing: bool, device: torch.device,
                distributed: bool, sync_batchnorm: bool = False) -> Parallelized:
    """`model` moved to `device` and wrapped, in the order of the module docstring; collective
    when `distributed` (more than one rank: DDP or FSDP make the replicas rank 0's).

    Args:
        blocks: submodules of `model`, each checkpointed and sharded as one unit (see
            `model_blocks`); None: the model has none (activation checkpointing refused).
        strategy: "ddp" (replicas, gradients all-reduced) or "fsdp" (FSDP2 `fully_shard`).
        compile: the training forward through `torch.compile`.
        activation_checkpointing: recompute each block in the backward.
        distributed: more than one rank; with one, nothing is sharded or replicated.
        sync_batchnorm: BatchNorm over the global batch (with more than one rank).
    """
    model = model.to(device)
    if sync_batchnorm and distributed:
        model = convert_sync_batchnorm(model, device)
    if activation_checkpointing:
        checkpoint_blocks(model, blocks)
    if strategy == "fsdp":
        # fully_shard changes the model in place, so the compiled forward (traced at the first
        # step) runs through FSDP's hooks, each block gathered just before it runs.
        forward = torch.compile(model) if compile else model
        if distributed:
            shard(model, blocks, device)
        return Parallelized(model, model, forward)
    # DDP is a wrapper: the compiled forward is its (dynamo splits its graph at DDP's gradient
    # buckets, so the all-reduce of one bucket overlaps the backward of the next).
    wrapped = replicate(model, device) if distributed else model
    return Parallelized(model, wrapped, torch.compile(wrapped) if compile else wrapped)


def checkpoint_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None) -> None:
    """Replace each block in its parent by `checkpoint_wrapper(block)`: its activations are
    recomputed in the backward instead of kept (less memory, about a third more compute, the
    same numbers). A block in a checkpoint wrapper already is left as it is."""
    if not blocks:
        raise ConfigError(f"activation checkpointing recomputes a model's blocks; "
                          f"{type(model).__name__} declares none (shard_units())")
    wanted = {id(block) for block in blocks}
    found = {id(child): (parent, name) for parent in model.modules()
             for name, child in parent.named_children() if id(child) in wanted}
    if found.keys() != wanted:
        raise ConfigError(f"activation checkpointing: {len(wanted - found.keys())} of the "
                          f"blocks of {type(model).__name__} are not submodules of it")
    for block in blocks:
        parent, name = found[id(block)]
        if not isinstance(parent, CheckpointWrapper):
            parent.register_module(name, checkpoint_wrapper(block,
                                                            checkpoint_fn=_checkpoint_to_train))


def _checkpoint_to_train(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A checkpoint wrapper's call: torch.utils.checkpoint (non-reentrant, RNG state kept) where
    a backward follows, in training with gradients on; the block as it is elsewhere
    (evaluation, generation), where nothing is kept to recompute."""
    if block.training and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False, **kwargs)
    return block(*args, **kwargs)


def shard(model: nn.Module, blocks: Sequence[nn.Module] | None, device: torch.device) -> None:
    """FSDP2: `fully_shard` on each unit, then the root; in place, collective. Each unit is
    gathered just before it runs and freed after, so peak memory holds one unsharded unit
    rather than the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under its prototype name
        from torch.distributed._composable.fsdp import fully_shard

    # fully_shard keeps each rank's own slice of its local tensors: make them equal first.
    with torch.no_grad():
        broadcast_tensors([*model.parameters(), *model.buffers()])
    mesh = init_device_mesh(device.type, (get_world_size(),))
    for unit in shard_units(model, blocks):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_units(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[nn.Module]:
    """FSDP's units: the blocks, each as the model holds it (in its checkpoint wrapper, if it
    has one), or without blocks each child with parameters."""
    if blocks is None:
        return [c for c in model.children() if any(True for _ in c.parameters())]
    holders = {id(m._checkpoint_wrapped_module): m for m in model.modules()
               if isinstance(m, CheckpointWrapper)}
    return [holders.get(id(block), block) for block in blocks]


def replicate(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP's wrapper, which broadcasts rank 0's parameters. Buffers are broadcast here, because
    whether DDP does with its per-forward buffer sync off depends on the torch version; that
    sync would re-broadcast buffers before every forward (every micro-batch), and the learner
    broadcasts the few that can differ once per optimizer step instead (`replicated_buffers`)."""
    with torch.no_grad():
        broadcast_tensors(list(model.buffers()))
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **_NO_FORWARD_BUFFER_SYNC)


def replicated_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a replica may drift on (plain BatchNorm's running statistics, ...): all but
    the global-batch BatchNorms', which are equal everywhere."""
    return [b for m in model.modules() if not isinstance(m, GLOBAL_BATCHNORMS)
            for b in m.buffers(recurse=False)]


def plain_name(name: str) -> str:
    """A parameter's or buffer's name as the model without checkpoint wrappers has it."""
    return name.replace("_checkpoint_wrapped_module.", "")
