"""pytagi's `DDPSequential` (averaging by default, as pytagi) and `DDPConfig` on dptrain's."""

from __future__ import annotations

from typing import Any

import numpy as np

from dptrain.runtime import DDPConfig
from dptrain.pytagi.nn._convert import flat
from dptrain.pytagi.nn.sequential import Sequential
from dptrain.tagi.ddp import DDPSequential as EngineDDP

__all__ = ["DDPConfig", "DDPSequential"]


class DDPSequential:
    """Data-parallel pytagi network: each rank forwards its shard; `step()` applies the mean of
    the ranks' deltas (`average=True`, pytagi's default; dptrain.tagi's wrapper sums by
    default). Construction is collective (docs/tutorials/from_pytagi.md)."""

    def __init__(self, model: Sequential, config: DDPConfig, average: bool = True) -> None:
        self.model, self.config = model, config
        self._engine = EngineDDP(model.model, config, average=average)
        self._outputs: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, mu_x: Any, var_x: Any = None) -> tuple[np.ndarray, np.ndarray]:
        return self.forward(mu_x, var_x)

    def forward(self, mu_x: Any, var_x: Any = None) -> tuple[np.ndarray, np.ndarray]:
        mu, var = self._engine(mu_x, var_x)
        self._outputs = flat(mu), flat(var)
        return self._outputs

    def get_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        if self._outputs is None:
            raise RuntimeError("get_outputs() needs a forward first")
        return self._outputs

    def backward(self) -> None:
        self._engine.backward()

    def step(self) -> None:
        self._engine.step()

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    def barrier(self) -> None:
        self._engine.barrier()

    def output_to_host(self) -> None:
        """Outputs are returned on the host already."""

    def get_device_with_index(self) -> str:
        return str(self.config.device)

    @property
    def output_z_buffer(self):
        return self._engine.output_z_buffer

    @property
    def input_delta_z_buffer(self):
        return self._engine.input_delta_z_buffer

    @property
    def average(self) -> bool:
        return self._engine.average
