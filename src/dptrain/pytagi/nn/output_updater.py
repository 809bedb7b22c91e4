"""pytagi's `OutputUpdater` on dptrain.tagi's: pytagi's flat arrays, and its reading of an
observation array longer than the batch (a full batch's `var_obs` on a short last batch)."""

from __future__ import annotations

from typing import Any

import numpy as np

from dptrain.tagi import OutputUpdater as EngineUpdater
from dptrain.tagi.states import DeltaStates, HiddenStates


def _prefix(value: Any, size: int, name: str) -> Any:
    """The first `size` values of a flat array, as pytagi reads it; a shorter one is refused."""
    if np.isscalar(value):
        return value
    array = np.asarray(value).reshape(-1)
    if array.size < size:
        raise ValueError(f"{name} has {array.size} values, the last forward needs {size}")
    return array[:size]


class OutputUpdater:
    def __init__(self, model_device: str = "cpu") -> None:
        self.device = model_device
        self._engine = EngineUpdater(model_device)

    def update(self, output_states: HiddenStates, mu_obs: Any, var_obs: Any,
               delta_states: DeltaStates) -> None:
        n = output_states.mu_a.numel()
        self._engine.update(output_states, _prefix(mu_obs, n, "mu_obs"),
                            _prefix(var_obs, n, "var_obs"), delta_states)

    def update_using_indices(self, output_states: HiddenStates, mu_obs: Any, var_obs: Any,
                             selected_idx: Any, delta_states: DeltaStates) -> None:
        idx = np.asarray(selected_idx).reshape(-1).astype(np.int64)  # sized for this batch
        self._engine.update_using_indices(
            output_states, _prefix(mu_obs, idx.size, "mu_obs"),
            _prefix(var_obs, idx.size, "var_obs"), idx, delta_states)

    def update_heteros(self, output_states: HiddenStates, mu_obs: Any,
                       delta_states: DeltaStates) -> None:
        n = output_states.mu_a.numel() // 2
        self._engine.update_heteros(output_states, _prefix(mu_obs, n, "mu_obs"), delta_states)

