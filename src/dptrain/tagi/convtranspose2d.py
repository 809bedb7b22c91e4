"""2-D transposed convolution TAGI layer (docs/tagi.md, ConvTranspose2d), on torch's kernels.

Shape legend: B batch, C input channels, O output channels, k kernel size, H, W input height
and width, Ho, Wo output height and width, Hf, Wf the full (uncropped) transposed output.
Weights are (C, O, k, k) like torch's `ConvTranspose2d.weight` and pytagi's flat `mu_w`
(index ((c·O + o)·k + kh)·k + kw), biases (O,).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dptrain.tagi._spatial import Window, channels_last, positive_int
from dptrain.tagi.base import ParamLayer, init_scale
from dptrain.tagi.states import DeltaStates, HiddenStates

_conv_backward = torch.ops.aten.convolution_backward


class ConvTranspose2d(ParamLayer):
    """Z = W ⋆ᵀ A + B, the adjoint of a Conv2d's window map, with independent Gaussian W, B, A.

    Every input pixel spreads k×k weighted copies of itself over the output (stride apart),
    so each output unit is again a sum of products of independent Gaussians and the Linear
    formulas hold unit by unit; with `convT` = torch's `conv_transpose2d`::

        m_Z = convT(m_A, m_W) + m_B
        v_Z = convT(m_A² + v_A, v_W) + convT(v_A, m_W²) + v_B

    Backward: the adjoint of convT is the convolution with the same weights, so the input
    innovations are `J ⊙ conv(δm, m_W)` and `J² ⊙ conv(δv, m_W²)`, and the weight deltas are
    the weight gradient of convT, Δm_W = v_W ⊙ gW(m_A, δm), Δv_W = v_W² ⊙ gW(m_A², δv); one
    `convolution_backward` call gives all three of each pair.

    pytagi's arguments and defaults. Output size per dimension (pytagi's rule):
    `stride·(size − 1) + k − P` with P = 2·padding (`padding_type` 1: cut from every side,
    torch's meaning) or P = padding (type 2: cut from the right and bottom only, the adjoint
    of a Conv2d that pads right and bottom). `in_width`/`in_height` are optional (the input's
    shape is used); when given, inputs must have that size, and the layer also takes a flat
    (B, C·H·W) state (after a Linear, as in pytagi's decoders; the innovations go back flat)
    and a network starting with it takes pytagi's flat inputs. Init as Conv2d (pytagi):
    s = sqrt(1/(C k²)) for "He", sqrt(2/((C + O) k²)) for "Xavier", drawn at construction.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = True,
                 stride: int = 1, padding: int = 0, padding_type: int = 1, in_width: int = 0,
                 in_height: int = 0, gain_weight: float = 1.0, gain_bias: float = 1.0,
                 init_method: str = "He", *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        owner = "ConvTranspose2d"
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
        if in_width:  # an image this window cannot upsample fails now, not at the first step
            self.output_hw(owner, in_height, in_width)
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
        k = self.kernel_size
        return (self.in_channels, self.out_channels, k, k)

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

    def output_hw(self, owner: str, height: int, width: int) -> tuple[int, int]:
        """(Ho, Wo) = stride·(size − 1) + k − P per dimension; an error if not positive."""
        window = self.window
        sizes = tuple(window.stride * (size - 1) + window.kernel - window.total_padding
                      for size in (height, width))
        if min(sizes) < 1:
            raise ValueError(f"{owner}: a {height}x{width} input gives an output of "
                             f"{sizes[0]}x{sizes[1]}: the padding {window.total_padding} cuts "
                             f"more than stride·(size − 1) + kernel_size")
        return sizes

    def clear_cache(self) -> None:
        self._mu_a: torch.Tensor | None = None  # (B, C, H, W) input mean of the last forward
        self._mu_a_sq: torch.Tensor | None = None  # (B, C, H, W)
        self._mu_w_sq: torch.Tensor | None = None  # (C, O, k, k), also needed by the backward
        self._jcb: torch.Tensor | None = None  # (B, C, H, W) J of the input, None = 1
        self._in_shape: tuple[int, ...] = ()  # the input's shape: (B, C, H, W) or flat (B, N)
        self._full_hw: tuple[int, int] = (0, 0)  # (Hf, Wf) before a type-2 crop

    def _image(self, states: HiddenStates) -> tuple[torch.Tensor, torch.Tensor | None,
                                                    torch.Tensor | None]:
        """(m_A, v_A, J) as (B, C, H, W); a flat (B, C·H·W) state is unflattened C-major."""
        mu_a = states.mu_a
        sample = self.input_sample_shape()
        if sample is not None and mu_a.dim() == 2 and mu_a.shape[1] == math.prod(sample):
            shape = (mu_a.shape[0],) + sample
            return tuple(None if t is None else t.reshape(shape)
                         for t in (mu_a, states.var_a, states.jcb))
        hw = (self.in_height, self.in_width) if self.in_width else None
        want = (f"(batch, {self.in_channels}, " +
                (f"{hw[0]}, {hw[1]})" if hw else "height, width)"))
        if sample is not None:
            want += f" or flat (batch, {math.prod(sample)})"
        if (mu_a.dim() != 4 or mu_a.shape[1] != self.in_channels
                or (hw is not None and tuple(mu_a.shape[2:]) != hw)):
            hint = ("; give in_width and in_height to take a flat state"
                    if mu_a.dim() == 2 and sample is None else "")
            raise ValueError(f"{self.label}: expected an input of shape {want}, got "
                             f"{tuple(mu_a.shape)}{hint}")
        return mu_a, states.var_a, states.jcb

    def _convT(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """convT(x, weight) + bias over the full output, (B, O, Hf, Wf) channels-last."""
        window = self.window
        return channels_last(F.conv_transpose2d(x, weight, bias, window.stride,
                                                window.native_padding))

    def forward(self, states: HiddenStates) -> HiddenStates:
        mu_a, var_a, jcb = self._image(states)
        height, width = self.output_hw(self.label, mu_a.shape[2], mu_a.shape[3])
        mu_a, var_a = channels_last(mu_a), channels_last(var_a)
        mu_a_sq = mu_a * mu_a
        mu_z = self._convT(mu_a, self.mu_w, self.mu_b)
        mu_w_sq = None
        if var_a is None:  # a deterministic input needs only the m_A² term
            var_z = self._convT(mu_a_sq, self.var_w, self.var_b)
        else:
            mu_w_sq = self.mu_w * self.mu_w
            var_z = self._convT(mu_a_sq + var_a, self.var_w, self.var_b)
            var_z.add_(self._convT(var_a, mu_w_sq, None))
        if self.training:
            self._mu_a, self._mu_a_sq, self._mu_w_sq, self._jcb = mu_a, mu_a_sq, mu_w_sq, jcb
            self._in_shape = tuple(states.mu_a.shape)
            self._full_hw = (mu_z.shape[2], mu_z.shape[3])
        return HiddenStates(self._crop(mu_z, height, width), self._crop(var_z, height, width),
                            None)

    def _crop(self, z: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Type 2: keep the top-left (Ho, Wo) of the full output (the padded side is cut)."""
        if not self.window.pads_explicitly:
            return z
        return z[:, :, :height, :width].contiguous(memory_format=torch.channels_last)

    def _uncrop(self, delta: torch.Tensor) -> torch.Tensor:
        """Innovations of the cropped output, zero-padded back to the full (Hf, Wf)."""
        if not self.window.pads_explicitly:
            return channels_last(delta)
        full_h, full_w = self._full_hw
        pads = (0, full_w - delta.shape[3], 0, full_h - delta.shape[2])
        return channels_last(F.pad(delta, pads))

    def _backward_pair(self, delta: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                       need_input_delta: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(conv(delta, weight), gW(inputs, delta), Σ delta) through torch's conv backward."""
        s, p = self.window.stride, self.window.native_padding
        return _conv_backward(delta, inputs, weight, [self.out_channels] if self.bias else None,
                              [s, s], [p, p], [1, 1], True, [0, 0], 1,
                              [need_input_delta, True, self.bias])

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = gW(m_A, δm), g_v = gW(m_A², δv) (and Σ δm, Σ δv for the bias) into the
        delta buffers; Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py)."""
        if self._mu_a is None or self._mu_a_sq is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        mu_w_sq = self._mu_w_sq if self._mu_w_sq is not None else self.mu_w * self.mu_w
        in_mu, g_mu_w, g_mu_b = self._backward_pair(self._uncrop(delta.delta_mu), self._mu_a,
                                                    self.mu_w, need_input_delta)
        in_var, g_var_w, g_var_b = self._backward_pair(self._uncrop(delta.delta_var),
                                                       self._mu_a_sq, mu_w_sq, need_input_delta)
        # copy_ keeps the (flat-buffer) delta storage: views handed out stay live.
        self.delta_mu_w.copy_(g_mu_w)
        self.delta_var_w.copy_(g_var_w)
        if self.bias:
            self.delta_mu_b.copy_(g_mu_b)
            self.delta_var_b.copy_(g_var_b)
        if not need_input_delta:
            return None
        if self._jcb is not None:  # in place: both are fresh outputs of the kernel
            in_mu.mul_(self._jcb)
            in_var.mul_(self._jcb).mul_(self._jcb)
        # The innovations have the shape of the state they belong to (flat after a Linear).
        return DeltaStates(in_mu.reshape(self._in_shape), in_var.reshape(self._in_shape))

    def __repr__(self) -> str:
        extra = f", {self.window.describe()}"
        if not self.bias:
            extra += ", bias=False"
        if self.in_width:
            extra += f", in_width={self.in_width}, in_height={self.in_height}"
        return (f"ConvTranspose2d({self.in_channels}, {self.out_channels}, "
                f"{self.kernel_size}{extra})")
