"""ShardedSampler: which sample indices this rank visits, in which order, resumably.

Every rank draws the same permutation (a `torch.Generator` seeded with `seed + epoch`, never the
global RNG, so user code that draws random numbers cannot desynchronise ranks), then takes every
`world_size`-th index starting at its rank.

- mode="train": every rank takes the same number of steps, so no rank waits at a collective that
  another rank never reaches. By default the permutation is padded by wrapping around to a
  multiple of `world_size` (at most `world_size - 1` samples are seen twice per epoch);
  `drop_last=True` drops the tail instead (at most `world_size - 1` samples are skipped per
  epoch, different ones each epoch). Padding is the default because the small sets used here
  (20 toy points, 360 digits) would lose a noticeable share of their data per epoch, and because
  it matches `torch.utils.data.DistributedSampler`. `uneven_last_batch=True` neither pads nor
  drops: the epoch's last global batch holds just the samples left, split by the same striding,
  so a rank may get fewer samples in the last step, or none (an empty batch); for a learner
  whose update does not depend on how a global batch is split (TAGI's sum mode), every world
  size then computes the same steps.
- mode="eval": every index is visited exactly once over all ranks, no padding; ranks may hold
  counts that differ by one, so metrics are reduced as (sum, count) (docs/design.md, contract 5).

Steps and world sizes: a train epoch is a sequence of *slots*, ceil(n / world_size) per rank
(n // world_size with drop_last), slot j of rank r holding permutation position
r + j·world_size; padding fills the slots past n by wrapping around, `uneven_last_batch` leaves
them empty. Step k of a local batch B covers slots [kB, (k+1)B) on every rank, i.e. permutation
positions [k·G, (k+1)·G) with G = world_size·B, the global batch: the same samples on any world
size with the same G (up to the padding in an epoch's last step). The position counts slots, the
same on every rank at a step boundary, so a saved position means the first position·world_size
samples of the permutation, and `load_state_dict` continues it on another world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, Literal

import torch
from torch.utils.data import Sampler

from dptrain import runtime as dd
from dptrain.data.permutation import ComputedPermutation
from dptrain.errors import CheckpointError, ConfigError

Mode = Literal["train", "eval"]
_MODES = ("train", "eval")
Permutation = Literal["stored", "computed"]
_PERMUTATIONS = ("stored", "computed")
_ITER_CHUNK = 4096  # indices made at a time by __iter__
# Keys of state_dict() that describe the run rather than its progress: a checkpoint whose values
# differ cannot be resumed exactly, because the position would point into a different sequence.
# The world size is one only in eval mode and with drop_last (other samples exist per world
# size); in train mode a position maps onto any world size that divides it (load_state_dict).
_FIT_KEYS = ("num_samples", "mode", "shuffle", "drop_last")


def num_samples_per_rank(num_samples: int, world_size: int, rank: int, *, mode: Mode = "train",
                         drop_last: bool = False, uneven_last_batch: bool = False) -> int:
    """How many indices `rank` visits per epoch (what `len(ShardedSampler(...))` returns)."""
    if mode == "eval" or uneven_last_batch:
        return len(range(rank, num_samples, world_size))
    return _num_slots(num_samples, world_size, drop_last)


def _num_slots(num_samples: int, world_size: int, drop_last: bool) -> int:
    """Slots per rank of a train epoch (module docstring): the same on every rank."""
    if drop_last:
        return num_samples // world_size
    return math.ceil(num_samples / world_size)


def steps_per_epoch(num_samples: int, world_size: int, local_batch_size: int, *,
                    drop_last: bool = False, drop_partial: bool = False) -> int:
    """Steps every rank takes per training epoch (the same on all ranks in train mode).

    A step is one batch of `local_batch_size` indices per rank (the global batch is
    `world_size * local_batch_size`); the last, partial batch counts as a step unless
    `drop_partial`. Padded or `uneven_last_batch`, the same count: ceil(n / global batch).
    Use it for a learning-rate schedule's length or a progress bar.
    """
    _check_positive("local_batch_size", local_batch_size)
    per_rank = _num_slots(num_samples, world_size, drop_last)
    if drop_partial:
        return per_rank // local_batch_size
    return math.ceil(per_rank / local_batch_size)


def world_sizes_dividing(global_batch_size: int) -> list[int]:
    """The world sizes a global batch splits over evenly (its divisors), for error messages."""
    return [n for n in range(1, global_batch_size + 1) if global_batch_size % n == 0]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


def _resolve_length(dataset_or_length: Sized | int) -> int:
    if isinstance(dataset_or_length, bool):
        raise ConfigError(f"ShardedSampler needs a dataset or a length, got {dataset_or_length!r}")
    if isinstance(dataset_or_length, int):
        length = dataset_or_length
    elif hasattr(dataset_or_length, "__len__"):
        length = len(dataset_or_length)
    else:
        raise ConfigError("ShardedSampler needs a dataset with __len__ or an int length, got "
                          f"{type(dataset_or_length).__name__}")
    if length < 1:
        raise ConfigError(f"ShardedSampler needs at least one sample, got a length of {length}")
    return length


class ShardedSampler(Sampler[int]):
    """This rank's share of `range(num_samples)` for one epoch, resumable mid-epoch.

    Use it as a DataLoader `sampler=` (it yields ints), or call `batches(local_batch_size)` for index
    tensors to slice in-memory arrays. Call `set_epoch(e)` before every epoch (the Trainer does);
    without it every epoch repeats the same order.

    Position: the number of this epoch's slots already consumed (the indices yielded, plus in
    train mode with `uneven_last_batch` the empty slots past the data at the end: see the module
    docstring). An iterator starts at the position, so a sampler restored by `load_state_dict`
    (or given `set_position(n)`) yields exactly the indices not yet seen, in the same order; a
    position at the end of the epoch yields nothing. Only after an iterator of this object has
    run to the end does the next one start the epoch again from 0, so a sampler reused without
    `set_epoch` (an eval loop) repeats its epoch, as torch's DistributedSampler does.

    A DataLoader prefetches, so the indices its sampler has yielded run ahead of the batches
    the loop has consumed: the Trainer, which knows how many it consumed, should call
    `set_position(steps_done * local_batch_size)` before saving `state_dict()`.

    Args:
        dataset_or_length: anything with `__len__`, or the number of samples.
        rank, world_size: default to the running process group (0 and 1 without one).
        shuffle: draw a fresh permutation every epoch; defaults to True in train mode and False
            in eval mode (order does not change an evaluation).
        drop_last: train mode only; drop the tail instead of padding by wrapping.
        uneven_last_batch: train mode only; neither pad nor drop: the last step's batch holds
            the samples left, so a rank may get fewer than the others, or none.
        permutation: how a shuffled epoch's order is made. "stored": `torch.randperm`, held
            for the epoch (8 bytes per sample). "computed": a `ComputedPermutation`, evaluated
            for the indices asked for, so an epoch of millions of samples (the windows of a
            large token file) costs no memory. Defaults to the dataset's `permutation`
            attribute if it has one, else "stored". Both are functions of (seed, epoch) alone.

    Raises:
        ConfigError: bad rank, world size, mode, length, or drop_last or uneven_last_batch in
            eval mode, or both of them.
    """

    def __init__(self, dataset_or_length: Sized | int, *, rank: int | None = None,
                 world_size: int | None = None, shuffle: bool | None = None, seed: int = 0,
                 mode: Mode = "train", drop_last: bool = False,
                 uneven_last_batch: bool = False, permutation: Permutation | None = None) -> None:
        if mode not in _MODES:
            raise ConfigError(f"ShardedSampler mode must be one of {_MODES}, got {mode!r}")
        if permutation is None:
            permutation = getattr(dataset_or_length, "permutation", "stored")
        if permutation not in _PERMUTATIONS:
            raise ConfigError(f"ShardedSampler permutation must be one of {_PERMUTATIONS}, "
                              f"got {permutation!r}")
        if mode == "eval" and (drop_last or uneven_last_batch):
            flag = "drop_last" if drop_last else "uneven_last_batch"
            raise ConfigError(f"ShardedSampler(mode='eval') visits every sample exactly once; "
                              f"{flag}=True is only allowed in train mode")
        if drop_last and uneven_last_batch:
            raise ConfigError("ShardedSampler: drop_last=True drops the samples that "
                              "uneven_last_batch=True keeps; choose one")
        self.num_samples = _resolve_length(dataset_or_length)
        self.world_size = dd.get_world_size() if world_size is None else world_size
        self.rank = dd.get_rank() if rank is None else rank
        _check_positive("world_size", self.world_size)
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be an int in [0, world_size={self.world_size}), "
                              f"got {self.rank!r}")
        if mode == "train" and drop_last and self.num_samples < self.world_size:
            raise ConfigError(f"drop_last=True with {self.num_samples} sample(s) on "
                              f"{self.world_size} ranks leaves every rank empty")
        self.mode: Mode = mode
        self.shuffle = (mode == "train") if shuffle is None else bool(shuffle)
        self.seed = int(seed)
        self.drop_last = drop_last
        self.uneven_last_batch = bool(uneven_last_batch)
        self.permutation: Permutation = permutation
        self.epoch = 0
        self._position = 0
        self._ran_to_end = False
        self._stored: tuple[tuple[int, int], torch.Tensor] | None = None  # (seed, epoch), order

    def __len__(self) -> int:
        """This rank's number of indices for a whole epoch (not only the remaining ones)."""
        return num_samples_per_rank(self.num_samples, self.world_size, self.rank,
                                    mode=self.mode, drop_last=self.drop_last,
                                    uneven_last_batch=self.uneven_last_batch)

    @property
    def num_slots(self) -> int:
        """This rank's slots per epoch: `len(self)`, but with `uneven_last_batch` the same on
        every rank (the empty slots past the data included)."""
        if self.mode == "eval":
            return len(self)
        return _num_slots(self.num_samples, self.world_size, self.drop_last)

    @property
    def position(self) -> int:
        """How many of this epoch's slots have been consumed (or set with `set_position`)."""
        return self._position

    @property
    def num_remaining(self) -> int:
        """This epoch's slots not yet consumed; in train mode the same on every rank."""
        return self.num_slots - self._position

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation. A different epoch starts at position 0; setting the
        current epoch again keeps the position, so a resumed run may call it unconditionally."""
        if not _is_int(epoch) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            self._position = 0
            self._ran_to_end = False
        self.epoch = epoch

    def set_position(self, position: int) -> None:
        """Mark the first `position` slots of this epoch as consumed."""
        if not _is_int(position) or not 0 <= position <= self.num_slots:
            raise ConfigError(f"position must be an int in [0, {self.num_slots}] (slots per "
                              f"epoch on this rank), got {position!r}")
        self._position = position
        self._ran_to_end = False

    def indices(self) -> torch.Tensor:
        """All of this rank's indices for the current epoch, in order (int64, shape (len,))."""
        return self.indices_in_slots(0, len(self))

    def epoch_order(self) -> torch.Tensor:
        """Every rank's indices of the current epoch by global position (rank r takes
        positions r, r + world size, ...): the permutation, padded in train mode unless
        `uneven_last_batch`."""
        return self._order_at(torch.arange(self._num_positions()))

    def _num_positions(self) -> int:
        """Global positions of the epoch: n, or the padded total in padded train mode."""
        if self.mode == "train" and not self.uneven_last_batch:
            return self.world_size * len(self)
        return self.num_samples

    def _order_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The epoch's indices at global `positions`; padding wraps around to the start."""
        positions = positions % self.num_samples
        if not self.shuffle:
            return positions
        if self.permutation == "computed":
            return ComputedPermutation(self.num_samples, self.seed, self.epoch)[positions]
        key = (self.seed, self.epoch)
        if self._stored is None or self._stored[0] != key:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._stored = key, torch.randperm(self.num_samples, generator=g)
        return self._stored[1][positions]

    def indices_in_slots(self, begin: int, end: int) -> torch.Tensor:
        """This rank's indices in its slots [begin, end) of the epoch, whatever the position;
        a slot past the data (possible with `uneven_last_batch`) holds none."""
        positions = self.rank + self.world_size * torch.arange(begin, end)
        positions = positions[positions < self._num_positions()]
        return self._order_at(positions)

    def _start(self) -> None:
        if self._ran_to_end:
            self._position = 0
            self._ran_to_end = False

    def __iter__(self) -> Iterator[int]:
        self._start()
        slots = len(self)  # the slots that hold an index; any others are past the data
        for begin in range(self._position, slots, _ITER_CHUNK):
            for i, index in enumerate(self.indices_in_slots(begin, min(begin + _ITER_CHUNK,
                                                                        slots)).tolist()):
                self._position = begin + i + 1
                yield index
        self._position = self.num_slots  # the empty slots past the data, if any
        self._ran_to_end = True

    def batches(self, local_batch_size: int, *, drop_partial: bool = False
                ) -> Iterator[torch.Tensor]:
        """This rank's remaining indices in chunks of `local_batch_size` (int64 tensors).

        The last chunk of the epoch may be shorter; in train mode every rank gets as many chunks,
        so collectives still match, and padded they have the same length on every rank too
        (with `uneven_last_batch` the last ones may be shorter on some ranks, or empty).
        `drop_partial=True` skips a last chunk of fewer than `local_batch_size` slots (and
        counts it as consumed). Chunks start at the current position, so save at batch
        boundaries for a resumed run to see the same batches as an uninterrupted one.
        """
        _check_positive("local_batch_size", local_batch_size)
        self._start()
        slots = self.num_slots
        for start in range(self._position, slots, local_batch_size):
            end = min(start + local_batch_size, slots)
            if drop_partial and end - start < local_batch_size:
                self._position = slots
                break
            self._position = end
            yield self.indices_in_slots(start, end)
        self._ran_to_end = True

    def num_batches(self, local_batch_size: int, *, drop_partial: bool = False) -> int:
        """How many chunks `batches(local_batch_size)` yields for a whole epoch on this rank."""
        _check_positive("local_batch_size", local_batch_size)
        if drop_partial:
            return self.num_slots // local_batch_size
        return math.ceil(self.num_slots / local_batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Epoch, seed, permutation and position, plus the settings a resumed run must share.

        In train mode every rank holds the same state at a step boundary, so saving rank 0's is
        enough.
        """
        return {"epoch": self.epoch, "seed": self.seed, "permutation": self.permutation,
                "position": self._position,
                "num_samples": self.num_samples, "world_size": self.world_size,
                "mode": self.mode, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "uneven_last_batch": self.uneven_last_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off. The seed and the permutation come from `state` (a
        state without a permutation was saved before "computed" existed: "stored").

        On another world size (train mode, no drop_last) the saved position means the first
        position × saved world size samples of the epoch's permutation, and this sampler
        continues after them: its position is that count / world_size. Padded and
        `uneven_last_batch` states load into each other (the same samples, all but the padding).

        Raises:
            CheckpointError: a missing key, a state saved with a different dataset length, mode,
                shuffle or drop_last (its position would mean other samples), on another world
                size in eval mode or with drop_last, or at a sample count that this world size
                does not divide.
        """
        missing = [k for k in ("epoch", "seed", "position", "world_size", *_FIT_KEYS)
                   if k not in state]
        if missing:
            raise CheckpointError(f"sampler state is missing {missing}; got keys {sorted(state)}")
        mine = self.state_dict()
        fit_keys = _FIT_KEYS + (("world_size",) if self.mode == "eval" or self.drop_last
                                else ())
        differ = {k: (state[k], mine[k]) for k in fit_keys if state[k] != mine[k]}
        if differ:
            detail = ", ".join(f"{k}: saved {s!r}, now {m!r}" for k, (s, m) in differ.items())
            raise CheckpointError(f"sampler state does not fit this run ({detail}); resuming "
                                  "would visit other samples than the saved run")
        epoch, position, seed, world = (state[k] for k in ("epoch", "position", "seed",
                                                           "world_size"))
        saved_slots = _num_slots(self.num_samples, world, self.drop_last) \
            if _is_int(world) and world >= 1 else -1
        if not (_is_int(epoch) and epoch >= 0 and _is_int(seed)
                and _is_int(position) and 0 <= position <= saved_slots):
            raise CheckpointError(f"sampler state needs ints epoch >= 0, seed, world_size >= 1 "
                                  f"and position in [0, slots per rank], got epoch={epoch!r}, "
                                  f"seed={seed!r}, world_size={world!r}, "
                                  f"position={position!r}")
        permutation = state.get("permutation", "stored")
        if permutation not in _PERMUTATIONS:
            raise CheckpointError(f"sampler state: permutation must be one of {_PERMUTATIONS}, "
                                  f"got {permutation!r}")
        if world != self.world_size:
            position = self._position_from(position, world, saved_slots)
        self.epoch, self.seed, self._position = epoch, seed, position
        self.permutation = permutation
        self._ran_to_end = False

    def _position_from(self, position: int, world: int, saved_slots: int) -> int:
        """This sampler's position after `position` slots on each of `world` ranks."""
        if position == saved_slots:
            return self.num_slots  # the epoch is over on any world size
        # position < ceil(n / world), so position·world < n: only real samples were consumed,
        # the first `seen` positions of the permutation, whatever the world size was.
        seen = position * world
        if seen % self.world_size:
            raise CheckpointError(
                f"sampler state: {position} sample(s) per rank on {world} rank(s) = {seen} "
                f"samples of the epoch, which do not split over "
                f"{self.world_size} rank(s); resume from a step boundary on a world size that "
                f"divides the global batch")
        return seen // self.world_size


    def __repr__(self) -> str:
        return (f"ShardedSampler(num_samples={self.num_samples}, rank={self.rank}, "
                f"world_size={self.world_size}, mode={self.mode!r}, shuffle={self.shuffle}, "
                f"seed={self.seed}, permutation={self.permutation!r}, drop_last={self.drop_last}, "
                f"uneven_last_batch={self.uneven_last_batch}, epoch={self.epoch}, "
                f"position={self._position})")
