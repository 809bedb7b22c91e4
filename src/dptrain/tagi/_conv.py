"""What the convolution layers (Conv2d, ConvTranspose2d) share: arguments, parameters, moments.

Both are a sum of products of independent Gaussians over a k×k window, so they take the same
pytagi arguments, draw their weights and biases the same way, propagate moments with the same
three kernel calls and get their weight and input deltas from `convolution_backward`. What
differs stays in each layer: the weight layout (`_weight_shape`), the output size rule
(`_check_built_size`), how an input is read and how innovations are cropped.

Shape legend: B batch, C input channels, O output channels, k kernel size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from dptrain.tagi._spatial import Window, positive_int
from dptrain.tagi.base import ParamLayer, init_scale

_conv_backward = torch.ops.aten.convolution_backward

# (inputs, weight, bias) -> the layer's kernel applied to inputs, channels-last.
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ConvLayer(ParamLayer):
    """Base of Conv2d and ConvTranspose2d, with their (pytagi's) arguments and defaults;
    subclasses give `_weight_shape`, `_check_built_size` and `_transposed` (which
    `convolution_backward` the layer's deltas come from).

    Init (pytagi): m ~ N(0, s²), v = (gain·s)², s = sqrt(1/(C k²)) for "He",
    sqrt(2/((C + O) k²)) for "Xavier", drawn at construction.
    """

    _transposed: ClassVar[bool]

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = True,
                 stride: int = 1, padding: int = 0, padding_type: int = 1, in_width: int = 0,
                 in_height: int = 0, gain_weight: float = 1.0, gain_bias: float = 1.0,
                 init_method: str = "He", *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        owner = type(self).__name__
        self.in_channels = positive_int(owner, "in_channels", in_channels)
        self.out_channels = positive_int(owner, "out_channels", out_channels)
        self.window = Window.checked(owner, kernel_size, stride, padding, padding_type)
        self.kernel_size = kernel_size
        for name, value in (("in_width", in_width), ("in_height", in_height)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{owner}: {name} must be an int >= 0, got {value!r}")
        if (in_width == 0) != (in_height == 0):
            raise ValueError(f"{owner}: give both in_width and in_height (or neither), got "
                             f"in_width={in_width}, in_height={in_height}")
        self.in_width, self.in_height = in_width, in_height
        self.bias = bias
        super().__init__()
        if in_width:  # an image this window cannot take fails now, not at the first step
            self._check_built_size(in_height, in_width)
        fan = kernel_size * kernel_size
        scale = init_scale(init_method, fan * in_channels, fan * out_channels)
        self._init_group("w", self._weight_shape, scale, gain_weight, dtype, device)
        if bias:
            self._init_group("b", (out_channels,), scale, gain_bias, dtype, device)
        else:
            self.mu_b = self.var_b = self.delta_mu_b = self.delta_var_b = None
        self.clear_cache()

    @property
    def _weight_shape(self) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def _check_built_size(self, height: int, width: int) -> None:
        """Raise a ValueError if an in_height x in_width input has no valid output."""
        raise NotImplementedError

    def param_groups(self) -> list[tuple[str, tuple[int, ...]]]:
        groups: list[tuple[str, tuple[int, ...]]] = [("w", self._weight_shape)]
        if self.bias:
            groups.append(("b", (self.out_channels,)))
        return groups

    def input_sample_shape(self) -> tuple[int, ...] | None:
        """(C, H, W) when in_width/in_height were given: flat inputs can then be reshaped."""
        if not self.in_width:
            return None
        return (self.in_channels, self.in_height, self.in_width)

    def _moments(self, kernel: Kernel, mu_a: torch.Tensor, var_a: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(m_Z, v_Z, m_A², m_W² or None) with m_Z = K(m_A, m_W) + m_B and
        v_Z = K(m_A² + v_A, v_W) + K(v_A, m_W²) + v_B; a deterministic input (the usual
        network input) needs only K(m_A², v_W) + v_B, as in Linear."""
        mu_a_sq = mu_a * mu_a
        mu_z = kernel(mu_a, self.mu_w, self.mu_b)
        mu_w_sq = None
        if var_a is None:
            var_z = kernel(mu_a_sq, self.var_w, self.var_b)
        else:
            mu_w_sq = self.mu_w * self.mu_w
            var_z = kernel(mu_a_sq + var_a, self.var_w, self.var_b)
            var_z.add_(kernel(var_a, mu_w_sq, None))
        return mu_z, var_z, mu_a_sq, mu_w_sq

    def _kernel_backward(self, delta: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                         need_input_delta: bool
                         ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(input delta, gW(inputs, delta), Σ delta) through torch's conv backward: the input
        delta is the adjoint of the layer's kernel (convT for Conv2d, conv for its transpose)."""
        s, p = self.window.stride, self.window.native_padding
        return _conv_backward(delta, inputs, weight, [self.out_channels] if self.bias else None,
                              [s, s], [p, p], [1, 1], self._transposed, [0, 0], 1,
                              [need_input_delta, True, self.bias])

    def _backward_kernels(self, delta_mu: torch.Tensor, delta_var: torch.Tensor,
                          mu_a: torch.Tensor, mu_a_sq: torch.Tensor, mu_w_sq: torch.Tensor,
                          need_input_delta: bool
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Writes g_m = gW(m_A, δm), g_v = gW(m_A², δv) (and Σ δm, Σ δv for the bias) into the
        delta buffers and returns the input deltas (adjoint(δm, m_W), adjoint(δv, m_W²)), None
        each unless `need_input_delta`."""
        in_mu, g_mu_w, g_mu_b = self._kernel_backward(delta_mu, mu_a, self.mu_w,
                                                      need_input_delta)
        in_var, g_var_w, g_var_b = self._kernel_backward(delta_var, mu_a_sq, mu_w_sq,
                                                         need_input_delta)
        # copy_ keeps the (flat-buffer) delta storage: views handed out stay live.
        self.delta_mu_w.copy_(g_mu_w)
        self.delta_var_w.copy_(g_var_w)
        if self.bias:
            self.delta_mu_b.copy_(g_mu_b)
            self.delta_var_b.copy_(g_var_b)
        return in_mu, in_var

    @staticmethod
    def _times_jacobian_(jcb: torch.Tensor | None, in_mu: torch.Tensor,
                         in_var: torch.Tensor) -> None:
        """in_mu ⊙= J, in_var ⊙= J² (J None = 1), in place: both are fresh outputs of the
        kernel (or of a crop), owned by this layer."""
        if jcb is not None:
            in_mu.mul_(jcb)
            in_var.mul_(jcb).mul_(jcb)

    def __repr__(self) -> str:
        extra = f", {self.window.describe()}"
        if not self.bias:
            extra += ", bias=False"
        if self.in_width:
            extra += f", in_width={self.in_width}, in_height={self.in_height}"
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
                f"{self.kernel_size}{extra})")
