"""`BatchLoader`: one rank's batches of an epoch, in the sampler's order, decoded here or by
DataLoader worker processes, resumable at any step.

    loader = BatchLoader(split.train, sampler, local_batch_size=32, workers=2)
    sampler.set_epoch(epoch)
    for x, y in loader:             # the sampler's position counts the batches handed out
        ...
    loader.close()                  # stops the workers (also on any error)

A batch is asked for by its key (epoch, indices), and a dataset's random draws (augmentation)
are a function of (seed, epoch, sample index), so a batch is the same bits whichever process
makes it: `workers` never changes a result. Workers prefetch, but the sampler's position only
moves when a batch is handed to the training loop, so a checkpoint taken after step k resumes
at step k + 1, never past batches that were prefetched and not trained on.

Datasets: an `ArrayDataset` (and its image subclass) is indexed with the whole index tensor at
once; an `ImageFolderDataset` makes the batch itself (`batch(indices)`: each image decoded into
its row, in shared memory in a worker); any other map-style dataset item by item
(`dataset[i]` -> `(x, y)`), stacked with torch's default collate. Errors a worker meets in the
data (a corrupt image: `DataError`) reach the training process as the same one-line error.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import select
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from dptrain.data.datasets.base import ArrayDataset, Batch, Skipped, sample_shape
from dptrain.data.datasets.image_folder import ImageFolderDataset
from dptrain.data.mixing import Mixing, MixPlan, global_positions
from dptrain.data.sampler import ShardedSampler
from dptrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

WORKER_START_S = 30.0
"""How long a new worker process may take to report that it runs. A fork of a rank can hang
before it runs a line of Python: CPython 3.11 (gh-112275) deadlocks the child when the fork
lands while another thread registers with the interpreter, and a rank's gloo threads do that
when they release a finished collective's tensors. A healthy worker reports in milliseconds;
one that does not is stopped and the workers are started again."""

WORKER_STARTS = 3
"""Attempts at starting the workers before the loader gives up with an error."""

BatchKey = tuple[int, torch.Tensor, "MixPlan | None"]
"""(epoch, this rank's sample indices of one batch, their mixup/cutmix draws if any)."""


def fetch_batch(dataset: Dataset, epoch: int, indices: torch.Tensor) -> Batch:
    """The samples `indices` of `dataset` as drawn in `epoch`, stacked into one batch."""
    set_epoch = getattr(dataset, "set_epoch", None)
    if set_epoch is not None:
        set_epoch(epoch)
    if isinstance(dataset, ArrayDataset):
        batch = Batch(dataset[indices])
        batch.series = dataset.series_of(indices)
        return batch
    if isinstance(dataset, ImageFolderDataset):
        batch = dataset.batch(indices)
        if len(indices) and not len(batch[1]):
            raise DataError(f"every sample of a batch was left out: {batch.skipped[0]} (and "
                            f"{len(batch.skipped) - 1} more)")
        return batch
    if len(indices) == 0:  # a rank with no sample left still steps (collective evaluation)
        x, y = default_collate([dataset[0]])
        return Batch((x[:0], y[:0]))
    items = [dataset[int(i)] for i in indices]
    kept = [item for item in items if not isinstance(item, Skipped)]
    if not kept:
        raise DataError(f"every sample of a batch was left out: {items[0].reason} (and "
                        f"{len(items) - 1} more)")
    batch = Batch(default_collate(kept))
    batch.skipped = tuple(item.reason for item in items if isinstance(item, Skipped))
    return batch


class _Batches(Dataset):
    """What a worker is asked for: a whole batch by its key. A data error comes back as a
    value, so the training process raises it as the one line it is (DataLoader would wrap it
    in its worker traceback)."""

    def __init__(self, dataset: Dataset, mixing: Mixing | None = None) -> None:
        self.dataset, self.mixing = dataset, mixing

    def __getitem__(self, key: BatchKey) -> Any:
        try:
            return make_batch(self.dataset, *key, mixing=self.mixing)
        except DataError as err:
            return _Failure(str(err))


def make_batch(dataset: Dataset, epoch: int, indices: torch.Tensor, plan: MixPlan | None,
               *, mixing: Mixing | None) -> Batch:
    """`fetch_batch`, then mixed with the partners `plan` names (fetched here too)."""
    batch = fetch_batch(dataset, epoch, indices)
    if plan is None or mixing is None:
        return batch
    partner = fetch_batch(dataset, epoch, plan.partners)
    if len(batch[1]) != len(indices) or len(partner[1]) != len(indices):
        raise DataError("mixup/cutmix pair every sample with another: a batch cannot leave "
                        "unreadable images out (--bad-images skip)")
    mixed = Batch(mixing.apply(plan, tuple(batch), tuple(partner)))
    mixed.skipped = batch.skipped
    return mixed


class _Failure:
    def __init__(self, message: str) -> None:
        self.message = message


class _Keys(Sampler[BatchKey]):
    """The keys of the batches the loader is about to hand out, made as the DataLoader asks for
    them (an epoch of a large token file has millions); set anew for every pass. Each iterator
    starts the pass again (workers started again after a hung fork ask from the start)."""

    def __init__(self) -> None:
        self.keys: Callable[[], Iterator[BatchKey]] = lambda: iter(())
        self.count = 0

    def __iter__(self) -> Iterator[BatchKey]:
        return self.keys()

    def __len__(self) -> int:
        return self.count


class BatchLoader:
    """This rank's batches from `sampler`'s position to the end of its epoch.

    Args:
        workers: DataLoader worker processes that decode batches ahead of the training loop
            (0: the training process makes each batch when it is needed). They persist across
            epochs and are stopped by `close()`.
        pin_memory: page-locked batches, for fast copies to a CUDA device.
        prefetch: batches each worker makes ahead.
        mixing: mixup/cutmix of each sample with a partner from the same global batch
            (`dptrain.data.mixing`); train mode with equal shards only.
    """

    def __init__(self, dataset: Dataset, sampler: ShardedSampler, local_batch_size: int, *,
                 workers: int = 0, pin_memory: bool = False, prefetch: int = 2,
                 mixing: Mixing | None = None) -> None:
        if workers < 0:
            raise ConfigError(f"workers: expected an integer >= 0, got {workers}")
        if mixing is not None and (sampler.mode != "train" or sampler.uneven_last_batch):
            raise ConfigError("mixup/cutmix needs a train sampler with equal shards")
        self.dataset, self.sampler, self.mixing = dataset, sampler, mixing
        self.local_batch_size, self.workers = local_batch_size, workers
        self._keys = _Keys()
        self.skipped: set[str] = set()
        """Why each sample left out of a batch was (distinct reasons, each naming its file)."""
        self._loader: DataLoader | None = None
        self._started = False  # whether the workers are running (they persist across passes)
        self._ready_r = self._ready_w = -1  # each worker writes one byte here when it starts
        if workers:
            self._ready_r, self._ready_w = os.pipe()
            # Forked workers share the dataset's memory (a file list, uint8 images) instead of
            # a pickled copy each, and see classes defined in a user's dataset file.
            self._loader = DataLoader(
                _Batches(dataset, mixing), sampler=self._keys, batch_size=None, num_workers=workers,
                persistent_workers=True, pin_memory=pin_memory, prefetch_factor=prefetch,
                worker_init_fn=functools.partial(_start_worker, self._ready_w),
                collate_fn=_as_made)

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        return self.sampler.num_batches(self.local_batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        sampler, epoch = self.sampler, self.sampler.epoch
        start, slots, size = sampler.position, sampler.num_slots, self.local_batch_size
        # The sampler's batches() by slot, each made when asked for: no list of the epoch's
        # batches is held (an epoch of a large token file has millions of windows), and the
        # DataLoader's keys, drawn ahead of the loop, do not move the position a checkpoint
        # saves.
        begins = range(start, slots, size)
        ends = (min(begin + size, slots) for begin in begins)

        def keys() -> Iterator[BatchKey]:
            for begin, plan in zip(begins, self._plans(begins, slots)):
                yield epoch, sampler.indices_in_slots(begin, min(begin + size, slots)), plan

        if self._loader is None:
            made: Iterator[Any] = (make_batch(self.dataset, *key, mixing=self.mixing)
                                   for key in keys())
        else:
            self._keys.keys, self._keys.count = keys, len(begins)
            made = self._batches()
        for end, batch in zip(ends, made):
            if isinstance(batch, _Failure):
                raise DataError(batch.message)
            self.skipped.update(batch.skipped)
            # the batch's slots, which past the data (uneven_last_batch) hold no index
            sampler.set_position(end)
            yield batch

    def _plans(self, begins: range, slots: int) -> Iterator[MixPlan | None]:
        """Each batch's mixing draws (None without mixing), from its samples' global
        positions: every rank's local slot i is position i x world size + rank."""
        if self.mixing is None:
            yield from itertools.repeat(None, len(begins))
            return
        sampler, world = self.sampler, self.sampler.world_size
        order, shape = sampler.epoch_order(), sample_shape(self.dataset)
        for begin in begins:
            positions = global_positions(begin, min(begin + begins.step, slots), sampler.rank,
                                         world)
            yield self.mixing.plan(sampler.epoch, positions, order,
                                   self.local_batch_size * world, shape)

    def _batches(self) -> Iterator[Any]:
        """The DataLoader's pass; on the first, once every worker has reported that it runs."""
        assert self._loader is not None
        for attempt in range(1, WORKER_STARTS + 1):
            made = iter(self._loader)
            if self._started:
                return made
            missing = _await_bytes(self._ready_r, self.workers, WORKER_START_S)
            if not missing:
                self._started = True
                return made
            self._stop_workers()
            log.warning("%d of %d data loader worker(s) did not start within %g s (a fork "
                        "that hung before running: CPython gh-112275); starting them again "
                        "(attempt %d of %d)", missing, self.workers, WORKER_START_S,
                        attempt + 1, WORKER_STARTS)
        raise DataError(f"data loader workers did not start in {WORKER_STARTS} attempts of "
                        f"{WORKER_START_S:g} s each; --workers 0 makes batches in the "
                        f"training process")

    def _stop_workers(self) -> None:
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()  # terminates a worker that does not stop by itself
            self._loader._iterator = None  # type: ignore[union-attr]
        _drain(self._ready_r)
        self._started = False

    def close(self) -> None:
        """Stop the worker processes (they would also stop when this process ends)."""
        if self._loader is not None:
            self._stop_workers()
            self._loader = None
            os.close(self._ready_r)
            os.close(self._ready_w)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_made(batch: Any) -> Any:
    # A worker's item is a whole Batch already; torch's default would turn it into a list.
    return batch


def _start_worker(ready: int, worker_id: int) -> None:
    # A worker decodes one batch at a time; the rank's threads are for its training step.
    torch.set_num_threads(1)
    os.write(ready, b"1")


def _await_bytes(fd: int, count: int, timeout_s: float) -> int:
    """Read `count` bytes from the pipe `fd` within `timeout_s`; how many did not come."""
    deadline = time.monotonic() + timeout_s
    while count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        count -= len(os.read(fd, count))
    return count


def _drain(fd: int) -> None:
    """Discard what the pipe `fd` holds (a late worker's byte, from workers now stopped)."""
    while select.select([fd], [], [], 0)[0]:
        os.read(fd, 4096)
