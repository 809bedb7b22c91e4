"""What a `TorchLearner` checkpoints, in the forms its strategy needs.

    state = TorchState(module, optimizer, strategy="fsdp", scheduler=..., scaler=..., ema=...)
    saved = state.state_dict(steps)        # whole tensors (FSDP: gathered, collective)
    steps = state.load_state_dict(saved)   # the optimizer step count it was saved at
    state.save_sharded(path, steps)        # FSDP: each rank its shards (DCP), any world size
    steps = state.load_sharded(path)

Model and optimizer go through torch's own `state_dict` (DDP, one process) or its distributed
state-dict API (FSDP: whole tensors, or this rank's shards for torch.distributed.checkpoint);
beside them the scheduler, the fp16 scaler, the optimizer step count and the EMA's averaged
weights. Every name is the plain model's: `module.` (DDP) and activation checkpointing's
wrapper prefix never reach a checkpoint, so a run resumes with or without either.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from dptrain.errors import CheckpointError
from dptrain.learners.ema import WeightEma
from dptrain.learners.parallelize import plain_name
from dptrain.learners.shard_writer import ShardWriter
from dptrain.learners.torch_config import STATE_FORMAT
from dptrain.runtime import all_gather_object, barrier, is_initialized


class TorchState:
    """The checkpointable state of a set-up `TorchLearner`: its module (FSDP-sharded for
    strategy "fsdp"), optimizer, scheduler, scaler and EMA. FSDP: every method that reads or
    writes tensors is collective."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, strategy: str,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 scaler: torch.amp.GradScaler | None = None, ema: WeightEma | None = None,
                 shard_writer: ShardWriter | None = None) -> None:
        self.module, self.optimizer, self.strategy = module, optimizer, strategy
        self.scheduler, self.scaler, self.ema = scheduler, scaler, ema
        self.shard_writer = shard_writer
        """FSDP over more than one rank: writes shards in the background."""

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    # -- whole tensors ------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers as CPU copies under the plain module's names."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )
            state = get_model_state_dict(self.module,
                                         options=StateDictOptions(full_state_dict=True))
        else:
            state = self.module.state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def state_dict(self, steps: int) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler, EMA and `steps`, unsharded; live tensors."""
        if self.sharded:
            model, optim, initialized = self._dcp_state(full=True)
        else:
            model, optim, initialized = self.module.state_dict(), self.optimizer.state_dict(), True
        state = {"format": STATE_FORMAT, "strategy": self.strategy, "model": model,
                 "optimizer": optim, "extra": self._extra_state(steps, initialized)}
        if self.ema is not None:
            state["ema"] = self.ema_state_dict()
        return state

    def ema_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, whole tensors on the CPU under the plain module's names."""
        if self.ema is None:
            raise RuntimeError("this learner keeps no EMA (ema_decay=0)")
        return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
                .to("cpu", copy=True) for name, t in self._ema_tensors().items()}

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Restore what `state_dict` returned; the step count it was saved at."""
        check_state(state, self.strategy)
        model = copy.copy(state["model"])  # keeps torch's _metadata (module versions)
        consume_prefix_in_state_dict_if_present(model, "module.")
        try:
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import (
                    StateDictOptions,
                    set_state_dict,
                )
                set_state_dict(self.module, self.optimizer, model_state_dict=model,
                               optim_state_dict=state["optimizer"],
                               options=StateDictOptions(full_state_dict=True))
            else:
                self.module.load_state_dict(model)
                self.optimizer.load_state_dict(state["optimizer"])
            self._load_ema(state.get("ema"), whole=True)
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(f"learner state does not fit this model/optimizer: {err}") \
                from err
        return self._load_extra_state(state["extra"])

    # -- shards -------------------------------------------------------------------------------

    def save_sharded(self, path: str | os.PathLike, steps: int) -> None:
        """A torch.distributed.checkpoint (DCP) directory: each rank writes its own shards."""
        import torch.distributed.checkpoint as dcp

        run_dcp(dcp.save, self.sharded_state(steps), path)

    def sharded_state(self, steps: int) -> dict[str, Any]:
        """What `save_sharded` writes: this rank's shards, live (not copies)."""
        model, optim, initialized = self._dcp_state(full=False)
        state = {"model": model, "optimizer": optim,
                 "extra": self._extra_state(steps, initialized)}
        if self.ema is not None:
            state["ema"] = self._ema_tensors()  # each rank its shards, resharded on load
        return state

    def load_sharded(self, path: str | os.PathLike) -> int:
        """Read a `save_sharded` directory, resharding to this world size; the step count."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not Path(path, ".metadata").is_file():
            raise CheckpointError(f"{path}: not a sharded checkpoint (no .metadata file)")
        model, optim, _ = self._dcp_state(full=False)
        state = {"model": model, "optimizer": optim, "extra": self._extra_state(0, True)}
        if self.ema is not None:
            state["ema"] = self._ema_tensors()  # loaded in place
        try:
            run_dcp(dcp.load, state, path)
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as err:  # DCP's CheckpointException too
            raise CheckpointError(f"{path}: sharded checkpoint does not fit this learner: "
                                  f"{err}") from err
        return self._load_extra_state(state["extra"])

    # -- the Trainer's checkpoints ------------------------------------------------------------

    def save_checkpoint(self, directory: Path, steps: int, *, background: bool = False
                        ) -> dict[str, Any]:
        """DDP: the state, for rank 0's state file. FSDP: every rank writes its shards to
        `directory`/sharded, in the background with `background` and a shard writer."""
        if not self.sharded:
            return self.state_dict(steps)
        shards = Path(directory) / "sharded"
        if background and self.shard_writer is not None:
            self.shard_writer.start(self.sharded_state(steps), shards)
            return {}
        barrier()
        self.save_sharded(shards, steps)
        barrier()  # every shard is on disk before rank 0 checksums and publishes them
        return {}

    def checkpoint_written(self) -> None:
        if self.shard_writer is not None:
            self.shard_writer.wait()

    def load_checkpoint(self, state: dict[str, Any], directory: Path) -> int:
        if not self.sharded:
            return self.load_state_dict(state)
        shards = Path(directory) / "sharded"
        blind = [r for r, sees in enumerate(all_gather_object(shards.is_dir())) if not sees]
        if blind:
            raise CheckpointError(
                f"{shards}: rank(s) {blind} cannot see this sharded checkpoint; sharded (FSDP) "
                f"checkpoints need a run directory on a filesystem every node shares")
        return self.load_sharded(shards)

    # -- parts --------------------------------------------------------------------------------

    def _dcp_state(self, *, full: bool) -> tuple[dict, dict, bool]:
        """Model and optimizer state keyed by parameter name, through torch's distributed
        state-dict API; also whether the optimizer had state of its own."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        initialized = bool(self.optimizer.state)
        model, optim = get_state_dict(self.module, self.optimizer,
                                      options=StateDictOptions(full_state_dict=full))
        if not initialized:
            # torch created state with a zero-lr step to know its shapes (Adam's step = 1,
            # SGD momentum buffers = 0): drop it so training continues exactly as before.
            self.optimizer.state.clear()
        return model, optim, initialized

    def _ema_tensors(self) -> dict[str, torch.Tensor]:
        """The EMA's live tensors (this rank's shards under FSDP) under the plain names."""
        assert self.ema is not None
        return {plain_name(name): t for name, t in self.ema.state.items()}

    def _load_ema(self, saved: dict[str, torch.Tensor] | None, *, whole: bool) -> None:
        if (saved is None) != (self.ema is None):
            raise CheckpointError(f"checkpoint {'has' if saved is not None else 'lacks'} EMA "
                                  f"weights but this learner "
                                  f"{'keeps none' if self.ema is None else 'keeps them'} "
                                  f"(ema_decay)")
        if self.ema is None:
            return
        names = {plain_name(name): name for name in self.ema.state}
        unmatched = names.keys() ^ saved.keys()
        if unmatched:
            raise KeyError(f"EMA state does not match the model: {sorted(unmatched)[:5]}")
        saved = {names[name]: t for name, t in saved.items()}
        if whole and self.sharded:  # whole tensors into this rank's shards
            from torch.distributed.tensor import DTensor, distribute_tensor
            saved = {name: distribute_tensor(saved[name].to(t.device), t.device_mesh,
                                             t.placements)
                     if isinstance(t, DTensor) else saved[name]
                     for name, t in self.ema.state.items()}
        self.ema.load(saved)

    def _extra_state(self, steps: int, optimizer_initialized: bool) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "num_optimizer_steps": steps,
                "optimizer_initialized": optimizer_initialized}

    def _load_extra_state(self, extra: dict[str, Any]) -> int:
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            saved = extra.get(name)
            if (saved is None) != (obj is None):
                raise CheckpointError(f"checkpoint {'has' if saved is not None else 'lacks'} "
                                      f"{name} state but this learner "
                                      f"{'has no' if obj is None else 'has a'} {name}")
            if obj is not None:
                obj.load_state_dict(saved)
        if not extra.get("optimizer_initialized", True):
            self.optimizer.state.clear()
        return int(extra["num_optimizer_steps"])


def check_state(state: Any, strategy: str) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"not a TorchLearner state (format {STATE_FORMAT} expected, got "
                              f"{got!r})")
    missing = {"strategy", "model", "optimizer", "extra"} - state.keys()
    if missing:
        raise CheckpointError(f"TorchLearner state lacks {', '.join(sorted(missing))}")
    if state["strategy"] != strategy:
        raise CheckpointError(f"state was saved with strategy={state['strategy']!r}, this learner "
                              f"uses {strategy!r}; exchange models through model_state_dict()")


def run_dcp(fn: Callable[..., Any], state: dict[str, Any], path: str | os.PathLike) -> None:
    if is_initialized():
        fn(state, checkpoint_id=path)
        return
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes one process: that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        fn(state, checkpoint_id=path, no_dist=True)
