"""A seeded permutation of range(n) computed one position at a time, in O(1) memory.

`torch.randperm(n)` holds n int64s: 13 MB for the 1.6 M windows of a 100 M-token file, and
it grows with the file. `ComputedPermutation(n, seed, epoch)[positions]` gives the same kind of
answer, a bijection of range(n) that depends on (seed, epoch) alone, from the positions asked
for: a batch's worth at a time, so an epoch of any length costs no memory.

How: a balanced Feistel network on 2h-bit integers (2^2h >= n, h as small as that allows) is a
bijection of range(2^2h) whatever its round function; a value that lands at or above n is sent
through the network again ("cycle walking") until it lands below n, which keeps the map a
bijection of range(n) (each cycle of the big permutation is walked in order, skipping the
values outside). 2^2h < 4n, so fewer than 4 passes are needed on average. The round function is
a 32-bit integer hash of the half and a round key; the keys come from (seed, epoch) through
numpy's SeedSequence, so every process, on any CPU, computes the same permutation: it is
integer arithmetic only.
"""

from __future__ import annotations

import numpy as np
import torch

ROUNDS = 6
_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2^27: a product with a 32-bit value fits in an int64
_KEY_STREAM = 0x9E37_79B9
"""Tells the keys' random stream apart from the others seeded by (seed, epoch)."""


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 32-bit hash of each element of x (int64 values in [0, 2^32))."""
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK32
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK32
    return (x >> 16) ^ x


class ComputedPermutation:
    """A permutation of range(n), a pure function of (n, seed, epoch), evaluated per position.

    Args:
        n: how many elements; at least 1 and below 2^64.
        seed, epoch: any non-negative ints; another (seed, epoch) gives another permutation.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._half_mask = (1 << self.half_bits) - 1
        sequence = np.random.SeedSequence([int(seed), int(epoch), _KEY_STREAM])
        self._keys = [int(k) for k in sequence.generate_state(ROUNDS, dtype=np.uint32)]

    def _network(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x >> self.half_bits, x & self._half_mask
        for key in self._keys:
            left, right = right, left ^ (_hash32(right ^ key) & self._half_mask)
        return (left << self.half_bits) | right

    def __getitem__(self, positions: torch.Tensor) -> torch.Tensor:
        """The permutation's values at `positions` (int64, each in [0, n)), same shape."""
        positions = torch.as_tensor(positions, dtype=torch.int64)
        if positions.numel() and not (0 <= int(positions.min())
                                      and int(positions.max()) < self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        values = self._network(positions)
        outside = values >= self.n
        while bool(outside.any()):
            values[outside] = self._network(values[outside])
            outside = values >= self.n
        return values

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"ComputedPermutation(n={self.n}, rounds={ROUNDS})"
