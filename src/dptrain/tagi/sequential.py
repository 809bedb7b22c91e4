"""Sequential: the TAGI network, with pytagi's loop (forward, update, backward, step).

Shape legend: B batch, I input width, N output width, P flat parameter count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, overload

import torch

from dptrain.tagi import _io
from dptrain.tagi._inputs import as_input, checked_output_delta, float_dtype
from dptrain.tagi._pack import ParameterPack, StatePack
from dptrain.tagi.base import Layer, ParamLayer, cap_factor
from dptrain.tagi.compiled import CompiledStep
from dptrain.tagi.slstm import smooth_layers
from dptrain.tagi.states import DeltaStates, HiddenStates


class Sequential(Layer):
    """Layers applied in order; also usable as a nested block inside another Sequential.

    Training step (docs/tagi.md, One training step), exactly pytagi's::

        mu, var = net(x)                       # forward, x: (B, I) tensor or array
        updater.update(net.output_z_buffer, y, var_y, net.input_delta_z_buffer)
        net.backward()                         # parameter deltas, overwritten each time
        net.step()                             # capped update of every parameter

    The network has no autograd graph; every call runs under `torch.no_grad()`. Parameters
    live in one flat (2, P) buffer (`flat_params`; row 0 means, row 1 variances) with deltas in
    `flat_deltas`; every layer's `mu_w, var_w, delta_mu_w, …` are views of them. Non-parameter
    state (BatchNorm's running statistics `mu_ra, var_ra, num_batches_tracked`) lives in a third
    flat buffer, `flat_state`; it is updated by training forwards, not by `step()`, and
    `state_dict`, `save`, `load` and `to()` cover it like the parameters.

    Attributes for a data-parallel wrapper:
        cap_batch_size: when not None, `step()` uses the cap factor c(cap_batch_size) instead of
            c(last_batch_size); set it to the global batch so that N ranks summing their deltas
            step exactly like one process on the whole batch (docs/tagi.md, Data-parallel TAGI).
        last_batch_size: batch size of the last forward in training mode (None before one).
        input_state_update: if True, `backward()` also computes the innovations for the input x
            into `input_delta_x` (pytagi's flag of the same name); default False.
        check_inputs: validate forward inputs for NaN/inf (one reduction and one host sync per
            forward); default True.
        allow_empty_batch: accept a batch of 0 samples (default False: an error). A
            data-parallel wrapper sets it for a rank that holds no sample of a step: its
            forward, update and backward still run (its BatchNorm layers contribute a count of 0
            to synchronised statistics) and give zero deltas, so it takes part in every
            collective of the step; `step()` then needs `cap_batch_size`.
        deltas_ready: when set (a callable taking a column index `start`), `backward()` turns
            each top-level layer's g into Δ as soon as that layer is done and then calls
            `deltas_ready(start)`: columns [start, P) of `flat_deltas` are final, so a
            data-parallel wrapper can start reducing them while earlier layers compute.
            None (default): all deltas are scaled at once at the end.
    """

    def __init__(self, *layers: Layer, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential: argument {i} must be a dptrain.tagi layer, "
                                f"got {type(layer).__name__}")
        self.layers: list[Layer] = list(layers)
        super().__init__()
        self.cap_batch_size: int | None = None
        self.last_batch_size: int | None = None
        self.input_state_update = False
        self.check_inputs = True
        self.allow_empty_batch = False
        self.deltas_ready: Callable[[int], None] | None = None
        self._columns: list[tuple[int, int]] | None = None
        self.output_z_buffer: HiddenStates | None = None
        self.input_delta_z_buffer = DeltaStates()
        self.input_delta_x: DeltaStates | None = None
        self._last_forward_trained = False
        self._first_param = next((i for i, layer in enumerate(self.layers)
                                  if not layer.is_activation), len(self.layers))
        self.set_labels()
        leaves = self.parametric_leaves()
        if len({id(leaf) for leaf in leaves}) != len(leaves):
            raise ValueError("Sequential: a layer object appears twice; use separate layers")
        first = leaves[0].param_groups()[0][0] if leaves else None
        if dtype is None:
            dtype = getattr(leaves[0], f"mu_{first}").dtype if leaves else torch.float32
        if device is None:
            device = getattr(leaves[0], f"mu_{first}").device if leaves else "cpu"
        self._pack: ParameterPack | None = None
        self._state_pack: StatePack | None = None
        self._build_pack(torch.device(device), float_dtype(dtype))

    # ------------------------------------------------------------------ structure
    def named_children(self) -> list[tuple[str, Layer]]:
        return [(str(i), layer) for i, layer in enumerate(self.layers)]

    def _build_pack(self, device: torch.device, dtype: torch.dtype) -> None:
        for layer in self.descendants():
            if isinstance(layer, Sequential):  # a block: its storage now lives here
                layer._pack = layer._state_pack = None
        self._device, self._dtype = device, dtype
        self._pack = ParameterPack(self.parametric_leaves(), dtype, device)
        self._state_pack = StatePack([layer for _, layer in self.named_stateful()], dtype,
                                     device)
        self._bindings_checked = False
        self.clear_cache()

    def _owned_pack(self) -> ParameterPack:
        if self._pack is None or self._state_pack is None:
            raise RuntimeError(f"{self.label}: this Sequential is a block of another one; call "
                               "step() / flat buffers on the outermost Sequential")
        return self._pack

    def layer_delta_columns(self) -> list[tuple[int, int]]:
        """[start, end) of each top-level layer's columns in `flat_deltas` (and `flat_params`);
        (s, s) for a layer without parameters. A nested block's leaves are contiguous, so every
        top-level layer owns one contiguous slice, and the slices follow the layer order."""
        if self._columns is not None:  # the layers' shapes never change after construction
            return self._columns
        columns, start = [], 0
        for layer in self.layers:
            leaves = [layer] if isinstance(layer, ParamLayer) else layer.parametric_leaves()
            end = start + sum(math.prod(shape) for leaf in leaves
                              for _, shape in leaf.param_groups())
            columns.append((start, end))
            start = end
        self._columns = columns
        return columns

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.clear_cache()
        self.output_z_buffer = None
        self.input_delta_z_buffer = DeltaStates()
        self.input_delta_x = None

    def reset_lstm_states(self) -> None:
        """Zero the hidden and cell states every LSTM layer (nested ones included) carries
        from one forward to the next (pytagi's name; docs/tagi.md, LSTM)."""
        for layer in self.descendants():
            if not isinstance(layer, Sequential) and hasattr(layer, "reset_lstm_states"):
                layer.reset_lstm_states()

    def smoother(self) -> tuple[torch.Tensor, torch.Tensor]:
        """pytagi's smoother for a time series run through SLSTM layers one step per call
        (docs/tagi.md, SLSTM and the smoother): every SLSTM (nested ones included, in order)
        smooths the steps it recorded since the last call and zeroes its carried states, and
        the SLinear after it maps the smoothed hidden states to smoothed outputs.

        Returns the last SLinear's smoothed output means and variances, (T, B, O) for T
        recorded steps of B series; pytagi's flat array of one series is `mu.reshape(-1)`.
        The smoothed states stay on the SLSTM layers (`mu_h_smooths`, … `var_c_smooths`).
        """
        with torch.no_grad():
            return smooth_layers(layer for layer in self.descendants()
                                 if not isinstance(layer, Sequential))

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        """Where parameters and states live; inputs are moved here by `forward`."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """torch.float32 (default) or torch.float64; inputs are cast to it by `forward`."""
        return self._dtype

    @property
    def flat_params(self) -> torch.Tensor:
        """(2, P) live storage of all parameters: row 0 means, row 1 variances."""
        return self._owned_pack().params

    @property
    def flat_deltas(self) -> torch.Tensor:
        """(2, P) live storage of all parameter deltas, same layout as `flat_params`."""
        return self._owned_pack().deltas

    @property
    def flat_state(self) -> torch.Tensor:
        """(S,) live storage of all non-parameter state (running statistics), in the order of
        `named_state_tensors`; empty for a network without BatchNorm."""
        self._owned_pack()
        assert self._state_pack is not None
        return self._state_pack.state

    def named_parameter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter tensor (mu_w, var_w, mu_b, var_b per parametric leaf, nested ones
        included), depth first in layer order; names are the `state_dict` keys.

        The tensors are live storage (views of `flat_params`): in-place writes change the
        model. They stay valid until `to()` moves the network.
        """
        return [(f"{path}.{name}", tensor) for path, leaf in self.named_leaves()
                for name, tensor in leaf.named_parameter_tensors()]

    def named_delta_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The live delta buffers (delta_mu_w, delta_var_w, delta_mu_b, delta_var_b) in the
        order of `named_parameter_tensors`. Valid after `backward()`; in-place edits before
        `step()` (e.g. an all-reduce) change what `step()` applies."""
        return [(f"{path}.{name}", tensor) for path, leaf in self.named_leaves()
                for name, tensor in leaf.named_delta_tensors()]

    def named_state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every non-parameter state tensor (`<path>.mu_ra`, `.var_ra`, `.num_batches_tracked`
        of each BatchNorm, nested ones included): live views of `flat_state`."""
        return [(f"{path}.{name}", tensor) for path, layer in self.named_stateful()
                for name, tensor in layer.named_state_tensors()]

    # ------------------------------------------------------------------ the loop
    @overload
    def forward(self, mu_x: HiddenStates, var_x: None = None) -> HiddenStates: ...

    @overload
    def forward(self, mu_x: Any, var_x: Any = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, mu_x: Any, var_x: Any = None) -> Any:
        """Propagate moments; returns (mu, var) of the output, each (B, N) torch tensors.

        `mu_x`: (B, I) (or (B, C, H, W)) tensor or array, converted to the network's dtype and
        device; `var_x`: its variances (default 0). A network whose first layer is a Conv2d
        given in_width/in_height also takes pytagi's flat (B, C·H·W) or (B·C·H·W,) arrays.
        Raises ValueError for NaN/inf or negative input variances, and (from the first layer)
        for a wrong input shape. In training mode the batch size is recorded for the step cap.
        The innovations of an earlier update are discarded, so a `backward()` without a fresh
        update fails instead of reusing them.
        Given a `HiddenStates` (the call of an enclosing Sequential) it returns `HiddenStates`.
        """
        if isinstance(mu_x, HiddenStates):
            with torch.no_grad():
                return self._forward_states(mu_x)
        self.input_delta_z_buffer.delta_mu = self.input_delta_z_buffer.delta_var = None
        mu, var = as_input(mu_x, var_x, self._dtype, self._device, self.check_inputs,
                           self.input_sample_shape(), allow_empty=self.allow_empty_batch)
        with torch.no_grad():
            states = self._forward_states(HiddenStates(mu, var, None))
        if self.training:
            self.last_batch_size = mu.shape[0]
        self._last_forward_trained = self.training
        self.output_z_buffer = states
        return states.mu_a, states.var_or_zeros()

    __call__ = forward

    def input_sample_shape(self) -> tuple[int, ...] | None:
        """The first parametric layer's sample shape, e.g. (C, H, W) of a Conv2d built with
        in_width/in_height: `forward` then also accepts pytagi's flat (B, C·H·W) and (B·C·H·W,)
        inputs and reshapes them (C-major, as `torch.flatten`)."""
        if self._first_param == len(self.layers):
            return None
        return self.layers[self._first_param].input_sample_shape()

    def _forward_states(self, states: HiddenStates) -> HiddenStates:
        for layer in self.layers:
            states = layer.forward(states)
        return states

    def backward(self, delta: DeltaStates | None = None,
                 need_input_delta: bool | None = None) -> DeltaStates | None:
        """Propagate the innovations in `input_delta_z_buffer` (written by the OutputUpdater)
        to every layer, overwriting each parametric layer's delta buffers.

        Activations are skipped: the next parametric layer applies their J (see docs/tagi.md).
        A nested call passes `delta` explicitly and gets the input innovations back.
        """
        top_level = delta is None
        if top_level:
            delta = checked_output_delta(self.output_z_buffer, self.input_delta_z_buffer)
            if not self._last_forward_trained:
                raise RuntimeError("backward() needs the last forward in training mode "
                                   "(net.train()); it was an evaluation forward")
            need_input_delta = self.input_state_update
        ready = self.deltas_ready if self._pack is not None else None
        with torch.no_grad():
            if ready is None:
                delta = self._backward_layers(delta, bool(need_input_delta))
                if self._pack is not None:  # the outermost Sequential owns the delta storage
                    self._pack.scale_deltas()
            else:
                delta = self._backward_announcing(delta, bool(need_input_delta), ready)
        if top_level and not self._bindings_checked:
            self._check_bindings()
        if top_level:
            self.input_delta_x = delta if need_input_delta else None
        return delta

    def _backward_layers(self, delta: DeltaStates, need_input_delta: bool
                         ) -> DeltaStates | None:
        """The layer loop of `backward()`, last layer first (also traced by a compiled step)."""
        for i in range(len(self.layers) - 1, self._first_param - 1, -1):
            layer = self.layers[i]
            if not layer.is_activation:
                delta = layer.backward(delta, need_input_delta or i > self._first_param)
        return delta

    def _backward_announcing(self, delta: DeltaStates, need_input_delta: bool,
                             ready: Callable[[int], None]) -> DeltaStates | None:
        """The layer loop of `backward()`, scaling and announcing each parametric top-level
        layer's deltas as soon as it is done (see `deltas_ready`)."""
        assert self._pack is not None
        columns = self.layer_delta_columns()
        for i in range(len(self.layers) - 1, self._first_param - 1, -1):
            layer = self.layers[i]
            if layer.is_activation:
                continue
            delta = layer.backward(delta, need_input_delta or i > self._first_param)
            start, end = columns[i]
            if end > start:
                self._pack.scale_deltas(start, end)
                ready(start)
        return delta

    def _check_bindings(self) -> None:
        """Once after the first backward (and again after `to()`): every parameter, delta and
        state attribute must still be the flat buffers' view. A layer that re-assigned one
        (`self.delta_mu_w = …` instead of writing into it) would silently stop being stepped,
        all-reduced or saved."""
        assert self._pack is not None and self._state_pack is not None
        detached = self._pack.detached() + self._state_pack.detached()
        if detached:
            raise RuntimeError(f"{', '.join(detached)}: re-assigned instead of written in place "
                               "(use copy_ / out=); the attribute no longer points into the "
                               "network's flat buffer, so it would be neither stepped nor "
                               "synchronised")
        self._bindings_checked = True

    def step(self) -> None:
        """Capped update of every parameter with its current delta (docs/tagi.md, Capped step).

        The cap factor is c(cap_batch_size) if that is set, else c(last_batch_size).
        Deltas are not cleared: calling step() twice applies them twice.
        """
        pack = self._owned_pack()
        batch = self.cap_batch_size if self.cap_batch_size is not None else self.last_batch_size
        if batch is None:
            raise RuntimeError("step() needs a forward in training mode first (or set "
                               "cap_batch_size)")
        with torch.no_grad():
            pack.step(cap_factor(batch))

    def compile(self, update: str = "plain", backend: str = "inductor",
                mode: str | None = None, native: bool | None = None) -> CompiledStep:
        """The training step as one compiled call: `step = net.compile()`, then per batch
        `mu, var = step(x, y, var_y)` does forward, update ("plain", "indices" with
        `selected_idx=`, or "heteros"), backward and step, with the same parameters as the
        eager loop (docs/tagi.md, Compiled step). Falls back to eager, with one log line, for
        a network it cannot capture. `mode="reduce-overhead"` replays it as a CUDA graph.
        `native`: a stack of LSTM, Linear and ReLU layers (and an EvenExp head) steps
        through the native library where it is measured faster (None), wherever it can
        (True), or never (False). `step.predict(x)` is the evaluation forward, through the
        same library where the step is native."""
        return CompiledStep(self, update, backend=backend, mode=mode, native=native)

    # ------------------------------------------------------------------ modes, devices, state
    def to(self, *args: torch.device | str | torch.dtype, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> Sequential:
        """Move and/or cast in place: `to("cuda")`, `to(torch.float64)`, `to(device, dtype)`.

        Rebuilds the flat buffers, so tensors obtained earlier from `named_*_tensors` no longer
        alias the model; stored forward states are dropped.
        """
        for arg in args:
            if isinstance(arg, torch.dtype):
                dtype = arg
            else:
                device = arg
        self._owned_pack()
        self._build_pack(torch.device(device) if device is not None else self._device,
                         float_dtype(dtype) if dtype is not None else self._dtype)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter tensor, keyed `<layer path>.<mu_w|var_w|mu_b|var_b>`
        (e.g. "0.mu_w", "2.var_b"; a block's inner layer "3.1.mu_w", a residual block's
        "3.main.0.mu_w" / "3.short.0.mu_w"), then of every state tensor
        (`<path>.mu_ra`, `.var_ra`, `.num_batches_tracked` of each BatchNorm)."""
        return {name: tensor.detach().clone() for name, tensor in
                self.named_parameter_tensors() + self.named_state_tensors()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy parameters and state in (strict: same keys, same shapes, finite, variances > 0,
        batch counters whole numbers >= 0).

        Everything is validated before anything is written. Raises ValueError naming the key.
        """
        _io.load_into(self.named_parameter_tensors() + self.named_state_tensors(), state)

    def save(self, path: str) -> None:
        """Write the parameters to `path` atomically (a plain tensor file, no pickled code)."""
        _io.save(path, self.state_dict(), repr(self))

    def load(self, path: str) -> None:
        """Read parameters written by `save`; loading never executes pickled code.

        Raises dptrain.errors.CheckpointError for an unreadable file or one that does not fit
        this architecture.
        """
        _io.load(path, self)

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in getattr(self, "layers", []))
        return f"Sequential({inner})"

