"""What every TAGI layer shares: the layer protocol, parameter init, and the capped step.

A layer maps `HiddenStates` forward and `DeltaStates` backward (docs/tagi.md). Parametric
layers own Gaussian parameters named pytagi's way: `mu_<p>, var_<p>` and the proposed increments
`delta_mu_<p>, delta_var_<p>` for each parameter group p ("w", "b"). A `Sequential` re-binds
these attributes to views of one flat buffer so that `step()` is a handful of ops for the whole
network; a layer never assumes it owns its storage.

Every TAGI parameter delta has the form Δm = v ⊙ g_m and Δv = v² ⊙ g_v, where g only involves
innovations and states (Cov(θ, Z) = v_θ ∂Z/∂θ). A layer's `backward` therefore writes g_m, g_v
into its delta buffers and the owner of the storage applies the v, v² factors afterwards: a
`Sequential` in two ops over its flat buffer (`scale_deltas_`), a lone layer through
`ParamLayer.scale_deltas_()`. After `Sequential.backward()` the buffers hold the true deltas.

Shape legend: B batch, I inputs, O outputs, P flat parameter count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from dptrain.tagi import _rng
from dptrain.tagi.states import DeltaStates, HiddenStates

#: Variance written where a capped update leaves a variance ≤ 0 (docs/tagi.md, Capped step).
VAR_FLOOR = 1e-5


def cap_factor(batch_size: int) -> float:
    """c(B) of the capped step: 0.1 for B = 1, 2 for 1 < B < 256, 3 for B ≥ 256."""
    if batch_size < 1:
        raise ValueError(f"cap batch size must be >= 1, got {batch_size}")
    if batch_size == 1:
        return 0.1
    return 2.0 if batch_size < 256 else 3.0


def scale_deltas_(params: torch.Tensor, deltas: torch.Tensor) -> None:
    """In place on (2, ...) stacks: deltas[0] *= v, deltas[1] *= v², v = params[1]."""
    StepRows(params, deltas).scale_deltas_()


def capped_update_(params: torch.Tensor, deltas: torch.Tensor, factor: float,
                   scratch: torch.Tensor | None = None) -> None:
    """In place: `m += clip(Δm, ±bar)`, `v += clip(Δv, ±bar)`, `bar = sqrt(v_old)/c`; v ≤ 0 → 1e-5.

    `params` and `deltas` are (2, P): row 0 means, row 1 variances (docs/tagi.md, Capped step).
    `scratch`, if given, is a (4, P) buffer reused across calls: a fresh ~P-sized allocation per
    step costs page faults that show up at batch 32.
    """
    StepRows(params, deltas, scratch).capped_update_(factor)


class StepRows:
    """The row views `scale_deltas_` and `capped_update_` work on, made once: a network that
    steps the same (2, P) buffers every batch keeps one, and its step is then five ops
    instead of a dozen (at batch 5 the views cost as much as the passes)."""

    def __init__(self, params: torch.Tensor, deltas: torch.Tensor,
                 scratch: torch.Tensor | None = None) -> None:
        if scratch is None:
            scratch = torch.empty((4,) + tuple(params.shape[1:]), dtype=params.dtype,
                                  device=params.device)
        self.params, self.deltas = params, deltas
        self.var, self.delta_var = params[1], deltas[1]
        self.bounds, self.clipped = scratch[:2], scratch[2:]  # (2, P) each
        self.lower, self.upper, self.root = self.bounds[0], self.bounds[1], self.clipped[0]

    def scale_deltas_(self) -> None:
        self.deltas.mul_(self.var)
        self.delta_var.mul_(self.var)

    def capped_update_(self, factor: float) -> None:
        """Five passes over the parameters, the bounds ±bar in one of them. clamp(Δ, −bar, bar)
        equals sign(Δ)·min(|Δ|, bar) because bar ≥ 0."""
        root = torch.sqrt(self.var, out=self.root)  # from the pre-update variance
        torch.mul(root, _signed_inverse(factor, self.params), out=self.bounds)  # −bar, +bar
        self.params.add_(torch.clamp(self.deltas, min=self.lower, max=self.upper,
                                     out=self.clipped))
        # threshold: v if v > 0 else VAR_FLOOR, i.e. exactly the floor rule, in one fused op.
        F.threshold_(self.var, 0.0, VAR_FLOOR)


_SIGNED_INVERSES: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def _signed_inverse(factor: float, like: torch.Tensor) -> torch.Tensor:
    """The (2, 1) column (−1/c, 1/c) in `like`'s dtype and device, made once per factor.

    sqrt(v)·(−1/c) is exactly −(sqrt(v)·(1/c)): both bounds come out of one multiplication.
    """
    key = (factor, like.dtype, like.device)
    if key not in _SIGNED_INVERSES:
        _SIGNED_INVERSES[key] = torch.tensor([[-1.0 / factor], [1.0 / factor]],
                                             dtype=like.dtype, device=like.device)
    return _SIGNED_INVERSES[key]


_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-dim tensor in `like`'s dtype and device, made once.

    An op with a Python number first wraps it into a fresh tensor: on the tiny tensors of a
    small batch (the LSTM's (5, 5, 4, 8) gates) that costs as much as the op itself.
    """
    key = (value, like.dtype, like.device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return _CONSTANTS[key]


def finite(x: torch.Tensor) -> torch.Tensor:
    """torch.isfinite(x) in two ops instead of four: x − x is 0 exactly where x is finite."""
    return torch.eq(x - x, constant(0.0, x))


LayerT = TypeVar("LayerT", bound="Layer")


class Layer:
    """Base of every layer: `forward(states)`, and `backward(delta, need_input_delta)`.

    `label` names the layer in error messages; `Sequential` sets it to include the position.
    Activations set `is_activation = True`: `Sequential.backward` skips them, because the next
    parametric layer already multiplies its input innovations by their J (docs/tagi.md).
    """

    is_activation = False

    def __init__(self) -> None:
        self.training = True
        self.label = repr(self)

    def forward(self, states: HiddenStates) -> HiddenStates:
        raise NotImplementedError

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Consume innovations for this layer's output, write parameter deltas, and return the
        innovations for the previous layer's pre-activation Z (None if not `need_input_delta`)."""
        raise NotImplementedError

    # Containers (Sequential now; residual blocks later) list their sub-layers here; the walks
    # below then give every container the same parameter order, names and labels.
    def named_children(self) -> list[tuple[str, Layer]]:
        return []

    def named_leaves(self, prefix: str = "") -> Iterator[tuple[str, ParamLayer]]:
        """(path, layer) of every parametric leaf below, depth first ("2", "3.0", …)."""
        for name, child in self.named_children():
            if isinstance(child, ParamLayer):
                yield f"{prefix}{name}", child
            else:
                yield from child.named_leaves(f"{prefix}{name}.")

    def named_stateful(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """(path, layer) of every layer below that keeps non-parameter state (BatchNorm's
        running statistics), depth first in the order of `named_leaves`."""
        for name, child in self.named_children():
            if child.state_groups():
                yield f"{prefix}{name}", child
            yield from child.named_stateful(f"{prefix}{name}.")

    # Non-parameter state (running statistics): tensors updated by forward, not by step(),
    # saved and synchronised like parameters. A Sequential re-binds them to views of one flat
    # buffer, so a layer must update them in place (copy_, mul_), never re-assign them.
    def state_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        """(attribute, shape) of this layer's own state tensors, in state_dict order."""
        return []

    def named_state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, _ in self.state_groups():
            yield name, getattr(self, name)

    def parametric_leaves(self) -> list[ParamLayer]:
        """Layers owning parameters, nested ones included, in a fixed order."""
        return [leaf for _, leaf in self.named_leaves()]

    def descendants(self) -> Iterator[Layer]:
        for _, child in self.named_children():
            yield child
            yield from child.descendants()

    def set_labels(self, prefix: str = "") -> None:
        """Name every sub-layer by its position, for error messages: "layer 2.0 (Linear(…))"."""
        for name, child in self.named_children():
            child.label = f"layer {prefix}{name} ({child!r})"
            child.set_labels(f"{prefix}{name}.")

    def train(self: LayerT, mode: bool = True) -> LayerT:
        """Training mode (default): forwards store what backward needs and record the batch
        size for the step cap. Returns self."""
        self.training = mode
        for _, child in self.named_children():
            child.train(mode)
        return self

    def eval(self: LayerT) -> LayerT:
        """Evaluation mode: forwards change no state used by backward or step."""
        return self.train(False)

    def clear_cache(self) -> None:
        """Drop what the last training forward stored for backward (after a device change)."""

    def check_values(self, states: Any) -> None:
        """Check what the forward checks by reading values on the host (the network input of a
        first layer), raising its ValueError. A compiled step calls it before the program,
        whose traced forward cannot read values; the eager forward checks them itself."""

    def drop_forward(self) -> None:
        """Drop what the last training forward stored for backward, this layer's own (a
        container's children are called on their own), keeping what carries over to the next
        step. A compiled step calls it on every layer once its backward has run, so those
        tensors live inside the program instead of each coming out of it per step."""
        if not self.named_children():
            self.clear_cache()

    def input_sample_shape(self) -> tuple[int, ...] | None:
        """The shape of one input sample when this layer knows it and it is not flat, e.g.
        (C, H, W) of a Conv2d given in_width/in_height; a network starting with such a layer
        reshapes pytagi's flat inputs to it. None: inputs are taken as they come."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ParamLayer(Layer):
    """A layer with Gaussian parameters; subclasses list their groups in `param_groups()`."""

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        """(group, shape) pairs, e.g. [("w", (O, I)), ("b", (O,))], in state_dict order."""
        raise NotImplementedError

    def named_parameter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group, _ in self.param_groups():
            yield f"mu_{group}", getattr(self, f"mu_{group}")
            yield f"var_{group}", getattr(self, f"var_{group}")

    def named_delta_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group, _ in self.param_groups():
            yield f"delta_mu_{group}", getattr(self, f"delta_mu_{group}")
            yield f"delta_var_{group}", getattr(self, f"delta_var_{group}")

    def scale_deltas_(self) -> None:
        """Turn the g_m, g_v written by `backward` into Δm = v g_m, Δv = v² g_v, for a layer
        used outside a Sequential (a Sequential does this for all its layers at once)."""
        for group, _ in self.param_groups():
            var = getattr(self, f"var_{group}")
            getattr(self, f"delta_mu_{group}").mul_(var)
            getattr(self, f"delta_var_{group}").mul_(var).mul_(var)

    def bind(self, group: str, mu: torch.Tensor, var: torch.Tensor, delta_mu: torch.Tensor,
             delta_var: torch.Tensor) -> None:
        """Point one parameter group at new storage (views of a flat buffer)."""
        setattr(self, f"mu_{group}", mu)
        setattr(self, f"var_{group}", var)
        setattr(self, f"delta_mu_{group}", delta_mu)
        setattr(self, f"delta_var_{group}", delta_var)

    def _init_group(self, group: str, shape: tuple[int, ...], scale: float, gain: float,
                    dtype: torch.dtype, device: torch.device | str | None) -> None:
        """m ~ N(0, scale²), v = (gain·scale)² (docs/tagi.md, Initialisation); deltas start at 0.

        Draws are made in float64 on the CPU, then cast, so a seed gives the same parameters
        whatever the dtype and device.
        """
        mu = _rng.normal(shape, scale).to(dtype=dtype, device=device)
        var = torch.full(shape, (gain * scale) ** 2, dtype=dtype, device=device)
        self.bind(group, mu, var, torch.zeros_like(mu), torch.zeros_like(mu))


def init_scale(init_method: str, fan_in: int, fan_out: int) -> float:
    """He: sqrt(1/fan_in) (not sqrt(2/fan_in), as in cuTAGI); Xavier: sqrt(2/(fan_in+fan_out))."""
    if init_method == "He":
        return math.sqrt(1.0 / fan_in)
    if init_method == "Xavier":
        return math.sqrt(2.0 / (fan_in + fan_out))
    raise ValueError(f"init_method must be 'He' or 'Xavier', got {init_method!r}")
