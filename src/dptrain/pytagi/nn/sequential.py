"""pytagi's `Sequential` on a `dptrain.tagi.Sequential`: flat numpy arrays in and out, pytagi's
method names, its `state_dict` format."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import torch

from dptrain import tagi
from dptrain.pytagi.nn._convert import flat, from_pytagi, to_pytagi
from dptrain.tagi.states import DeltaStates, HiddenStates


class Sequential:
    """Layers (dptrain.tagi layers, pytagi's arguments) applied in order.

    `forward` takes pytagi's arrays (flat or shaped, or the `output_z_buffer` of another
    network, as pytagi's encoder-decoder loops pass) and returns flat float32 arrays
    (mu, var). `model` is the engine network, for anything dptrain.tagi offers beyond pytagi.
    """

    def __init__(self, *layers: tagi.Layer) -> None:
        self.model = tagi.Sequential(*layers)
        self.num_samples = 0  # pytagi's debugging count, kept only to be read back
        self._outputs: tuple[np.ndarray, np.ndarray] | None = None
        self._smoothed: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ the loop
    def __call__(self, mu_x: Any, var_x: Any = None) -> tuple[np.ndarray, np.ndarray]:
        return self.forward(mu_x, var_x)

    def forward(self, mu_x: Any, var_x: Any = None) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(mu_x, HiddenStates):  # another network's output_z_buffer
            # its innovations are wanted back (output_delta_z_buffer), as in pytagi
            mu_x, var_x = mu_x.mu_a, mu_x.var_a
            self.model.input_state_update = True
        mu, var = self.model(mu_x, var_x)
        self._outputs = flat(mu), flat(var)
        return self._outputs

    def backward(self) -> None:
        self.model.backward()

    def step(self) -> None:
        self.model.step()

    def get_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        if self._outputs is None:
            raise RuntimeError("get_outputs() needs a forward first")
        return self._outputs

    def set_delta_z(self, delta_mu: Any, delta_var: Any) -> None:
        """Write the output innovations by hand (instead of an OutputUpdater). Arrays of the
        output's size take its shape; others are stored as given, as pytagi does, and a
        `backward()` then refuses them naming both shapes."""
        out = self.model.output_z_buffer
        if out is None:
            raise RuntimeError("set_delta_z() needs a forward first")
        buffer = self.model.input_delta_z_buffer
        for name, value in (("delta_mu", delta_mu), ("delta_var", delta_var)):
            tensor = torch.as_tensor(np.asarray(value), dtype=out.mu_a.dtype,
                                     device=out.mu_a.device)
            if tensor.numel() == out.mu_a.numel():
                tensor = tensor.reshape(out.mu_a.shape)
            setattr(buffer, name, tensor)

    def smoother(self) -> tuple[np.ndarray, np.ndarray]:
        mu, var = self.model.smoother()
        self._smoothed = flat(mu), flat(var)
        return self._smoothed

    def get_outputs_smoother(self) -> tuple[np.ndarray, np.ndarray]:
        if self._smoothed is None:
            raise RuntimeError("get_outputs_smoother() needs smoother() first")
        return self._smoothed

    # ------------------------------------------------------------------ buffers
    @property
    def output_z_buffer(self) -> HiddenStates | None:
        return self.model.output_z_buffer

    @property
    def input_delta_z_buffer(self) -> DeltaStates:
        return self.model.input_delta_z_buffer

    @property
    def output_delta_z_buffer(self) -> DeltaStates:
        """The innovations of the network's input after `backward()` (pytagi's name), for an
        encoder in front of this network; needs `input_state_update` (set by a forward from
        another network's output_z_buffer)."""
        delta = self.model.input_delta_x
        if delta is None:
            raise RuntimeError("output_delta_z_buffer needs backward() with input_state_update "
                               "= True (or a forward from another network's output_z_buffer)")
        return delta

    @property
    def input_state_update(self) -> bool:
        return self.model.input_state_update

    @input_state_update.setter
    def input_state_update(self, value: bool) -> None:
        self.model.input_state_update = bool(value)

    @property
    def layers(self) -> list[tagi.Layer]:
        return self.model.layers

    # ------------------------------------------------------------------ modes and devices
    @property
    def device(self) -> str:
        return self.model.device.type

    def to_device(self, device: str) -> None:
        """"cpu", "cuda" or "cuda:<i>". Where CUDA is not usable the network stays on the CPU
        with a warning (pytagi's examples ask for "cuda" unconditionally; the numbers are the
        same, only slower)."""
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            warnings.warn(f"to_device({device!r}): CUDA is not available in this process; the "
                          f"network stays on the CPU", stacklevel=2)
            return
        self.model.to(device)

    def params_to_device(self) -> None:
        """Parameters already live where the network runs (no host copy to sync)."""

    def params_to_host(self) -> None:
        """Parameters are torch tensors readable from the host at any time."""

    def set_threads(self, num_threads: int) -> None:
        """torch's intra-op threads, at most the cores this process may use: torch's pool is
        per process (pytagi's is per network), and more threads than cores only slows it."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        torch.set_num_threads(max(1, min(int(num_threads), cores)))

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def preinit_layer(self) -> None:
        """Parameters are drawn when the layers are built, so there is nothing to do."""

    def reset_lstm_states(self) -> None:
        self.model.reset_lstm_states()

    # ------------------------------------------------------------------ parameters and state
    def state_dict(self) -> dict[str, tuple[list[float], ...]]:
        """pytagi's format: {"<Type>.<index>": (mu_w, var_w, mu_b, var_b)} of float lists."""
        return to_pytagi(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(from_pytagi(self.model, state_dict))

    def parameters(self) -> list[tuple[np.ndarray, ...]]:
        return [tuple(np.asarray(v, dtype=np.float32) for v in entry)
                for entry in self.state_dict().values()]

    def params_from(self, other: Sequential) -> None:
        self.model.load_state_dict(other.model.state_dict())

    def save(self, filename: str) -> None:
        self.model.save(filename)

    def load(self, filename: str) -> None:
        self.model.load(filename)

    def get_layer_stack_info(self) -> str:
        return "\n".join(repr(layer) for layer in self.model.layers)

    def get_lstm_states(self, time_step: int = -1) -> dict[int, tuple[np.ndarray, ...]]:
        """{layer index: (mu_h, var_h, mu_c, var_c)} flat, of every top-level LSTM/SLSTM: the
        states the next forward starts from, or (time_step >= 0) an SLSTM's smoothed states
        at that step of the last smoother() run."""
        states = {}
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer, tagi.LSTM):
                continue
            if time_step >= 0:
                if getattr(layer, "mu_h_smooths", None) is None:
                    raise RuntimeError(f"get_lstm_states({time_step}): layer {i} has no "
                                       f"smoothed states (an SLSTM after smoother())")
                values = tuple(getattr(layer, f"{n}_smooths")[time_step]
                               for n in ("mu_h", "var_h", "mu_c", "var_c"))
            else:
                values = layer.lstm_states()
            states[i] = tuple(flat(v) for v in values)
        return states

    def set_lstm_states(self, states: dict[int, Any]) -> None:
        for i, values in states.items():
            layer = self.model.layers[int(i)]
            if not isinstance(layer, tagi.LSTM):
                raise ValueError(f"set_lstm_states: layer {i} is {type(layer).__name__}, "
                                 f"not an LSTM")
            layer.set_lstm_states(*(np.asarray(v) for v in values))

    def __repr__(self) -> str:
        return repr(self.model)
