"""`DDPConfig`: pytagi's data-parallel configuration, plus `from_env()`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dptrain.runtime.env import DistEnv, resolve_env
from dptrain.runtime.group import BACKENDS
from dptrain.errors import ConfigError


@dataclass
class DDPConfig:
    """Where this rank sits and what it computes on; the same fields as pytagi's `DDPConfig`.

    `device_ids` lists the CUDA devices of one node (empty on CPU); rank r uses
    `device_ids[local_rank % len(device_ids)]`. pytagi indexes by global rank, which only works
    on one node; `local_rank` (not in pytagi) defaults to `rank`, matching it there.
    """

    device_ids: list[int] = field(default_factory=list)
    backend: str = "nccl"
    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"DDPConfig.backend must be one of {', '.join(BACKENDS)}, "
                              f"got {self.backend!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"DDPConfig.rank must be in [0, world_size={self.world_size}), "
                              f"got {self.rank}")
        if self.backend == "nccl" and not self.device_ids:
            raise ConfigError("DDPConfig.backend='nccl' needs device_ids (CUDA devices); use "
                              "backend='gloo' or 'auto' on CPU")

    @classmethod
    def from_env(cls, backend: str = "auto", environ: Mapping[str, str] | None = None) -> DDPConfig:
        """Rank and sizes from whichever launcher started us; devices from CUDA when usable."""
        env = resolve_env(environ)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(device_ids=list(range(gpus)), backend=backend, rank=env.rank,
                   world_size=env.world_size, local_rank=env.local_rank)

    @property
    def device(self) -> torch.device:
        if self.backend == "gloo" or not self.device_ids:
            return torch.device("cpu")
        local = self.rank if self.local_rank is None else self.local_rank
        return torch.device("cuda", self.device_ids[local % len(self.device_ids)])

    def matches(self, env: DistEnv) -> bool:
        return (self.rank, self.world_size) == (env.rank, env.world_size)
