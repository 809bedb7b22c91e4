"""Sequential: the TAGI network, with pytagi's loop (forward, update, backward, step).

Shape legend: B batch, I input width, N output width, P flat parameter count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dptrain.tagi import _io
from dptrain.tagi._pack import ParameterPack
from dptrain.tagi.base import Layer, ParamLayer, cap_factor
from dptrain.tagi.states import DeltaStates, HiddenStates


class Sequential(Layer):
    """Layers applied in order; also usable as a nested block inside another Sequential.

    Training step (TAGI_MATH.md §1), exactly pytagi's::

        mu, var = net(x)                       # forward, x: (B, I) tensor or array
        updater.update(net.output_z_buffer, y, var_y, net.input_delta_z_buffer)
        net.backward()                         # parameter deltas, overwritten each time
        net.step()                             # capped update of every parameter

    The network has no autograd graph; every call runs under `torch.no_grad()`. Parameters
    live in one flat (2, P) buffer (`flat_params`; row 0 means, row 1 variances) with deltas in
    `flat_deltas`; every layer's `mu_w, var_w, delta_mu_w, …` are views of them.

    Attributes for a data-parallel wrapper:
        cap_batch_size: when not None, `step()` uses the cap factor c(cap_batch_size) instead of
            c(last_batch_size); set it to the global batch so that N ranks summing their deltas
            step exactly like one process on the whole batch (TAGI_MATH.md §15.7).
        last_batch_size: batch size of the last forward in training mode (None before one).
        input_state_update: if True, `backward()` also computes the innovations for the input x
            into `input_delta_x` (pytagi's flag of the same name); default False.
        check_inputs: validate forward inputs for NaN/inf (one reduction and one host sync per
            forward); default True.
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
        self.output_z_buffer: HiddenStates | None = None
        self.input_delta_z_buffer = DeltaStates()
        self.input_delta_x: DeltaStates | None = None
        self._first_param = next((i for i, layer in enumerate(self.layers)
                                  if not layer.is_activation), len(self.layers))
        self._set_labels("")
        leaves = self.parametric_leaves()
        if len({id(leaf) for leaf in leaves}) != len(leaves):
            raise ValueError("Sequential: a layer object appears twice; use separate layers")
        first = leaves[0].param_groups()[0][0] if leaves else None
        if dtype is None:
            dtype = getattr(leaves[0], f"mu_{first}").dtype if leaves else torch.float32
        if device is None:
            device = getattr(leaves[0], f"mu_{first}").device if leaves else "cpu"
        self._pack: ParameterPack | None = None
        self._build_pack(torch.device(device), _float_dtype(dtype))

    # ------------------------------------------------------------------ structure
    def _set_labels(self, prefix: str) -> None:
        for i, layer in enumerate(self.layers):
            layer.label = f"layer {prefix}{i} ({layer!r})"
            if isinstance(layer, Sequential):
                layer._set_labels(f"{prefix}{i}.")

    def named_children(self) -> list[tuple[str, Layer]]:
        return [(str(i), layer) for i, layer in enumerate(self.layers)]

    def named_leaves(self, prefix: str = "") -> Iterator[tuple[str, ParamLayer]]:
        """(path, layer) of every parametric leaf, depth first; path as in state_dict keys."""
        for name, layer in self.named_children():
            if isinstance(layer, Sequential):
                yield from layer.named_leaves(f"{prefix}{name}.")
            elif isinstance(layer, ParamLayer):
                yield f"{prefix}{name}", layer

    def parametric_leaves(self) -> list[ParamLayer]:
        return [leaf for _, leaf in self.named_leaves()]

    def _build_pack(self, device: torch.device, dtype: torch.dtype) -> None:
        for layer in self.layers:
            if isinstance(layer, Sequential):
                layer._release_pack()
        self._device, self._dtype = device, dtype
        self._pack = ParameterPack(self.parametric_leaves(), dtype, device)
        self.clear_cache()

    def _release_pack(self) -> None:
        """Called when this Sequential becomes a block of another one, which owns the storage."""
        for layer in self.layers:
            if isinstance(layer, Sequential):
                layer._release_pack()
        self._pack = None

    def _owned_pack(self) -> ParameterPack:
        if self._pack is None:
            raise RuntimeError(f"{self.label}: this Sequential is a block of another one; call "
                               "step() / flat buffers on the outermost Sequential")
        return self._pack

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.clear_cache()
        self.output_z_buffer = None
        self.input_delta_z_buffer = DeltaStates()
        self.input_delta_x = None

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def flat_params(self) -> torch.Tensor:
        """(2, P) live storage of all parameters: row 0 means, row 1 variances."""
        return self._owned_pack().params

    @property
    def flat_deltas(self) -> torch.Tensor:
        """(2, P) live storage of all parameter deltas, same layout as `flat_params`."""
        return self._owned_pack().deltas

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

    # ------------------------------------------------------------------ the loop
    def forward(self, mu_x: Any, var_x: Any = None) -> Any:
        """Propagate moments; returns (mu, var) of the output, each (B, N) torch tensors.

        `mu_x`: (B, I) (or (B, C, H, W)) tensor or array, converted to the network's dtype and
        device; `var_x`: its variances (default 0). Raises ValueError for NaN/inf or negative
        input variances, and (from the first layer) for a wrong input shape. In training mode
        the batch size is recorded for the step cap. Given a `HiddenStates` (the call of an
        enclosing Sequential) it returns `HiddenStates`.
        """
        if isinstance(mu_x, HiddenStates):
            with torch.no_grad():
                return self._forward_states(mu_x)
        mu = self._as_input(mu_x, "mu_x")
        var = None
        if var_x is not None:
            var = self._as_input(var_x, "var_x")
            if var.shape != mu.shape:
                raise ValueError(f"var_x must have the shape of mu_x {tuple(mu.shape)}, "
                                 f"got {tuple(var.shape)}")
            if self.check_inputs and not bool((var >= 0).all()):
                raise ValueError(f"var_x must be >= 0, got min {var.min().item()}")
        with torch.no_grad():
            states = self._forward_states(HiddenStates(mu, var, None))
        if self.training:
            self.last_batch_size = mu.shape[0]
        self.output_z_buffer = states
        return states.mu_a, states.var_or_zeros()

    __call__ = forward

    def _forward_states(self, states: HiddenStates) -> HiddenStates:
        for layer in self.layers:
            states = layer.forward(states)
        return states

    def backward(self, delta: DeltaStates | None = None,
                 need_input_delta: bool | None = None) -> DeltaStates | None:
        """Propagate the innovations in `input_delta_z_buffer` (written by the OutputUpdater)
        to every layer, overwriting each parametric layer's delta buffers.

        Activations are skipped: the next parametric layer applies their J (TAGI_MATH.md §1).
        A nested call passes `delta` explicitly and gets the input innovations back.
        """
        top_level = delta is None
        if top_level:
            delta = self._checked_output_delta()
            need_input_delta = self.input_state_update
        with torch.no_grad():
            for i in range(len(self.layers) - 1, self._first_param - 1, -1):
                layer = self.layers[i]
                if not layer.is_activation:
                    delta = layer.backward(delta, bool(need_input_delta) or i > self._first_param)
            if self._pack is not None:  # the outermost Sequential owns the delta storage
                self._pack.scale_deltas()
        if top_level:
            self.input_delta_x = delta if need_input_delta else None
        return delta

    def step(self) -> None:
        """Capped update of every parameter with its current delta (TAGI_MATH.md §6).

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

    def _checked_output_delta(self) -> DeltaStates:
        out, delta = self.output_z_buffer, self.input_delta_z_buffer
        if out is None or delta.delta_mu is None or delta.delta_var is None:
            raise RuntimeError("backward() needs forward() and an OutputUpdater update first")
        for name in ("delta_mu", "delta_var"):
            got = getattr(delta, name)
            if got.shape != out.mu_a.shape:
                raise ValueError(f"input_delta_z_buffer.{name} has shape {tuple(got.shape)}, "
                                 f"the last forward's output has {tuple(out.mu_a.shape)}")
        return delta

    def _as_input(self, x: Any, name: str) -> torch.Tensor:
        if isinstance(x, np.ndarray) and not np.issubdtype(x.dtype, np.number):
            raise ValueError(f"{name} must be numeric, got dtype {x.dtype}")
        tensor = torch.as_tensor(x, dtype=self._dtype, device=self._device)
        if tensor.dim() < 2 or tensor.shape[0] == 0:
            raise ValueError(f"{name} must have shape (batch, features...) with batch >= 1, "
                             f"got {tuple(tensor.shape)}")
        # One reduction instead of a full isfinite pass; a NaN/inf anywhere makes the sum
        # non-finite, and the exact search below runs only then.
        if self.check_inputs and not torch.isfinite(tensor.sum()):
            bad = (~torch.isfinite(tensor)).nonzero()
            if len(bad):
                where = tuple(bad[0].tolist())
                raise ValueError(f"{name} contains {tensor[where].item()} at index {where} "
                                 f"(of shape {tuple(tensor.shape)}); inputs must be finite")
        return tensor

    # ------------------------------------------------------------------ modes, devices, state
    def train(self, mode: bool = True) -> Sequential:
        self.training = mode
        for layer in self.layers:
            if isinstance(layer, Sequential):
                layer.train(mode)
            else:
                layer.training = mode
        return self

    def eval(self) -> Sequential:
        return self.train(False)

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
                         _float_dtype(dtype) if dtype is not None else self._dtype)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter tensor, keyed `<layer path>.<mu_w|var_w|mu_b|var_b>`
        (e.g. "0.mu_w", "2.var_b"; a block's inner layer "3.1.mu_w")."""
        return {name: tensor.detach().clone() for name, tensor in self.named_parameter_tensors()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy parameters in (strict: same keys, same shapes, finite, variances > 0).

        Everything is validated before anything is written. Raises ValueError naming the key.
        """
        _io.load_into(self.named_parameter_tensors(), state)

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


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return dtype
