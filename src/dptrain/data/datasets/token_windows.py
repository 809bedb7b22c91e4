"""`TokenWindows`: a part of a token sequence as windows of `block_size` tokens, the samples
of a language model.

    windows = TokenWindows(source, 0, 1_000_000, block_size=64, name="train", seed=0,
                           shuffle_offset=True)
    windows.set_epoch(3)       # the epoch's offset: a function of (seed, epoch) alone
    x, y = windows[17]         # int64 (64,) each; y is x one token later

Sample i of an epoch is the window starting at `offset + i * block_size` of the part: the
windows of one epoch do not overlap and cover the part but for less than two blocks. A
training part draws the offset anew every epoch (`epoch_offset`), so that a token is not
always at the same place of its window; which windows a rank sees and in which order is the
`ShardedSampler`'s seeded permutation of the sample indices, so an epoch's windows, every
rank's share of them and a resumed run's rest of them are the same on any world size.
Validation and test parts keep offset 0: fixed windows from the start of the part.

Sources: `TokenArray` (ids held in memory: a text) and `TokenFile` (ids read from a .bin
file a window at a time, never read whole).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.errors import DataError

_OFFSET_STREAM = 0x70CE5
"""Tells the offset's random stream apart from any other seeded by (seed, epoch)."""


def epoch_offset(seed: int, epoch: int, max_offset: int) -> int:
    """Where the windows of `epoch` start, in [0, max_offset]: a pure function of
    (seed, epoch), so every rank, every world size and every resumed run agree on it."""
    if max_offset <= 0:
        return 0
    sequence = np.random.SeedSequence([int(seed) % 2**64, int(epoch), _OFFSET_STREAM])
    return int(np.random.Generator(np.random.PCG64(sequence)).integers(0, max_offset + 1))


class TokenArray:
    """Token ids held in memory (a text's, a few bytes per character)."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.ids[start:stop].astype(np.int64)


class TokenFile:
    """Token ids in a file, `count` of `dtype` after `offset` header bytes, read a window at a
    time by position (`os.pread`): never read whole, and only the window is the process's.

    Why not a memory map: the pages of a mapping that were read count as the process's
    resident memory for as long as it is mapped, and the kernel maps them in blocks (64 KiB of
    fault-around, up to a large folio of a freshly written file on a recent kernel), so a
    mapping kept open grows towards the file's size, and one made anew for each window costs
    ~50 us against a positioned read's ~4 us (measured for bench/data/tokens_memory.py). The page
    cache still keeps the file's hot pages in memory, shared, as it would a mapping's.
    """

    def __init__(self, path: Path, dtype: np.dtype, offset: int, count: int) -> None:
        self.path, self.dtype, self.offset, self.count = Path(path), np.dtype(dtype), offset, count
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop) as int64."""
        if self._fd is None or self._pid != os.getpid():
            # a forked loader worker shares the descriptor (pread keeps no file position),
            # but opens its own so that closing one never closes the other's
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        size = self.dtype.itemsize
        want = (stop - start) * size
        data = os.pread(self._fd, want, self.offset + start * size)
        if len(data) != want:
            raise DataError(f"{self.path}: ids {start} to {stop} read {len(data)} of {want} "
                            f"bytes: the file changed after it was checked")
        return np.frombuffer(data, dtype=self.dtype).astype(np.int64)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # a spawned worker opens the file itself
        return {**self.__dict__, "_fd": None, "_pid": -1}


class TokenWindows(torch.utils.data.Dataset):
    """Windows of `block_size` tokens of `source[begin:end]`; sample i is (x, y), y = x one
    token later, both int64 of shape (block_size,).

    Raises:
        DataError: the part has fewer than block_size + 1 tokens (no window with its targets).
    """

    permutation = "computed"
    """The sampler computes the epoch's order per batch: a stored one would cost 8 bytes per
    window, memory that grows with the file (data/permutation.py)."""

    def __init__(self, source: TokenArray | TokenFile, begin: int, end: int, *,
                 block_size: int, name: str, seed: int = 0,
                 shuffle_offset: bool = False) -> None:
        size = end - begin
        if size < block_size + 1:
            raise DataError(f"{name}: --block-size {block_size} needs at least "
                            f"{block_size + 1} tokens (a window and its last target), but the "
                            f"part has {size}")
        self.source, self.begin, self.end = source, begin, end
        self.block_size, self.name, self.seed = block_size, name, int(seed)
        self.shuffle_offset = shuffle_offset
        if shuffle_offset:
            # one window fewer than fit, so that any offset below a block still fits them all
            self.num_windows = max(1, (size - block_size) // block_size)
            self.max_offset = min(block_size - 1, size - 1 - self.num_windows * block_size)
        else:
            self.num_windows = (size - 1) // block_size
            self.max_offset = 0
        self.offset = 0

    def __len__(self) -> int:
        return self.num_windows

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return (self.block_size,)

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin

    def set_epoch(self, epoch: int) -> None:
        """The epoch's window offset (the loader calls this before fetching its samples)."""
        self.offset = epoch_offset(self.seed, epoch, self.max_offset)

    def start_of(self, index: int) -> int:
        """Position in the source of window `index`'s first token, this epoch."""
        if not 0 <= index < self.num_windows:
            raise IndexError(f"{self.name}: window {index} of {self.num_windows}")
        return self.begin + self.offset + index * self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.start_of(int(index))
        chunk = torch.from_numpy(self.source.read(start, start + self.block_size + 1))
        return chunk[:-1], chunk[1:]

    def __repr__(self) -> str:
        return (f"TokenWindows({self.name!r}, {self.num_tokens} tokens, "
                f"{self.num_windows} windows of {self.block_size})")
