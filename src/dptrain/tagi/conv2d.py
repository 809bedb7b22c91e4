"""2-D convolution TAGI layer (docs/tagi.md, Conv2d), on torch's convolution kernels.

Shape legend: B batch, C input channels, O output channels, k kernel size, H, W input height
and width, Ho, Wo output height and width. Weights are (O, C, k, k) like torch's
`Conv2d.weight` and pytagi's flat `mu_w` (index ((o·C + c)·k + kh)·k + kw), biases (O,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptrain.tagi._spatial import Window, channels_last, check_image, positive_int
from dptrain.tagi.base import ParamLayer, init_scale
from dptrain.tagi.states import DeltaStates, HiddenStates

_conv_backward = torch.ops.aten.convolution_backward


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weightᵀ (+ bias): (N, K) x (O, K) -> (N, O)."""
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


class Conv2d(ParamLayer):
    """Z = W ⋆ A + B with independent Gaussian W, B, A; forward moments are exact.

    Forward (conv = cross-correlation with this layer's stride and padding)::

        m_Z = conv(m_A, m_W) + m_B
        v_Z = conv(m_A² + v_A, v_W) + conv(v_A, m_W²) + v_B

    (the same as conv(v_A, m_W² + v_W) + conv(m_A², v_W) + v_B). Backward: the innovations for
    the previous Z go through the transposed convolution, `J ⊙ convT(δm, m_W)` and
    `J² ⊙ convT(δv, m_W²)`; the weight deltas are the weight gradient of the convolution,
    Δm_W = v_W ⊙ gW(m_A, δm), Δv_W = v_W² ⊙ gW(m_A², δv), and the bias deltas sum δ over batch
    and positions. Both come from one `convolution_backward` call each (a deterministic
    1-channel input, the usual first layer on grey images, runs as matrix products over its
    patches instead, see `_forward_unfolded`). States are channels-last (see _spatial).

    pytagi's arguments and defaults. `padding_type` 1 pads every side, 2 only the right and
    bottom (see `_spatial`). `in_width`/`in_height` are optional (the input's shape is used);
    when given, inputs must have that size, and a network starting with this layer also takes
    pytagi's flat inputs (see `Sequential.forward`). Init (pytagi): m ~ N(0, s²), v = (gain·s)²,
    s = sqrt(1/(C k²)) for "He", sqrt(2/((C + O) k²)) for "Xavier", drawn at construction
    (pytagi draws at the first forward; copy parameters with `load_state_dict` for parity).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = True,
                 stride: int = 1, padding: int = 0, padding_type: int = 1, in_width: int = 0,
                 in_height: int = 0, gain_weight: float = 1.0, gain_bias: float = 1.0,
                 init_method: str = "He", *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        owner = "Conv2d"
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
        if in_width:  # an image that cannot pass this window fails now, not at the first step
            self.window.output_hw(repr(self), in_height, in_width)
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
        return (self.out_channels, self.in_channels, k, k)

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

    def clear_cache(self) -> None:
        self._mu_a: torch.Tensor | None = None  # (B, C, H', W') input mean, padded for type 2
        self._mu_a_sq: torch.Tensor | None = None  # (B, C, H', W')
        self._mu_w_sq: torch.Tensor | None = None  # (O, C, k, k), also needed by the backward
        self._jcb: torch.Tensor | None = None  # (B, C, H, W) J of the input, None = 1
        self._in_hw: tuple[int, int] = (0, 0)  # (H, W) of the unpadded input
        # (B·Ho·Wo, k²) patches of a deterministic 1-channel input and their squares, for
        # the weight gradients (see _forward_unfolded); None on the convolution path.
        self._patches: torch.Tensor | None = None
        self._patches_sq: torch.Tensor | None = None

    def _check_input(self, mu_a: torch.Tensor) -> None:
        check_image(self.label, mu_a, self.in_channels,
                    (self.in_height, self.in_width) if self.in_width else None)
        self.window.output_hw(self.label, mu_a.shape[2], mu_a.shape[3], mu_a.shape)

    def forward(self, states: HiddenStates) -> HiddenStates:
        self._check_input(states.mu_a)
        window = self.window
        stride, padding = window.stride, window.native_padding
        # Channels-last states (see _spatial): a no-op after the first image layer.
        mu_a = channels_last(window.pad(states.mu_a))  # (B, C, H', W')
        var_a = channels_last(window.pad(states.var_a))
        if var_a is None and self.in_channels == 1:
            return self._forward_unfolded(mu_a, states)
        mu_a_sq = mu_a * mu_a
        # (B, O, Ho, Wo); torch returns a 1-channel input's output in NCHW, hence the conversion.
        mu_z = channels_last(F.conv2d(mu_a, self.mu_w, self.mu_b, stride, padding))
        # As in Linear: (m_A² + v_A) ⋆ v_W + v_A ⋆ m_W², and a deterministic input (the usual
        # network input) needs only the first term.
        mu_w_sq = None
        if var_a is None:
            var_z = channels_last(F.conv2d(mu_a_sq, self.var_w, self.var_b, stride, padding))
        else:
            mu_w_sq = self.mu_w * self.mu_w
            var_z = F.conv2d(mu_a_sq + var_a, self.var_w, self.var_b, stride, padding)
            var_z.add_(F.conv2d(var_a, mu_w_sq, None, stride, padding))
        if self.training:
            self._mu_a, self._mu_a_sq, self._mu_w_sq, self._jcb = (
                mu_a, mu_a_sq, mu_w_sq, states.jcb)
            self._patches = self._patches_sq = None
            self._in_hw = (states.mu_a.shape[2], states.mu_a.shape[3])
        return HiddenStates(mu_z, var_z, None)

    def _forward_unfolded(self, mu_a: torch.Tensor, states: HiddenStates) -> HiddenStates:
        """A grey image (one channel, deterministic) as the first layer, as matrix products
        over its unfolded patches: m_Z = P m_Wᵀ + m_B, v_Z = P² v_Wᵀ + v_B, with P (B·Ho·Wo,
        k²) the patches of m_A. The same sums as the convolutions, but on the CPU torch's
        convolution kernels are slow for a single input channel (measured in bench/README.md,
        tagi_vs_pytagi.py, CNN); the weight gradients reuse P and P² (see `backward`). The result (B·Ho·Wo, O) is the channels-last (B, O, Ho, Wo) state as is."""
        batch, out = mu_a.shape[0], self.out_channels
        k, s, p = self.kernel_size, self.window.stride, self.window.native_padding
        height, width = ((size + 2 * p - k) // s + 1 for size in mu_a.shape[2:])
        patches = F.unfold(mu_a, k, padding=p, stride=s)  # (B, k², Ho·Wo)
        patches = patches.transpose(1, 2).reshape(-1, k * k)  # (B·Ho·Wo, k²)
        patches_sq = patches * patches
        mu_z = _affine(patches, self.mu_w.view(out, -1), self.mu_b)  # (B·Ho·Wo, O)
        var_z = _affine(patches_sq, self.var_w.view(out, -1), self.var_b)

        def image(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, height, width, out).permute(0, 3, 1, 2)  # channels-last

        if self.training:
            self._patches, self._patches_sq = patches, patches_sq
            self._mu_a, self._mu_a_sq, self._mu_w_sq, self._jcb = mu_a, None, None, states.jcb
            self._in_hw = (states.mu_a.shape[2], states.mu_a.shape[3])
        return HiddenStates(image(mu_z), image(var_z), None)

    def _backward_unfolded(self, delta: DeltaStates) -> None:
        """Weight and bias g of `_forward_unfolded`'s layer: g_m = δmᵀ P, g_v = δvᵀ P²."""
        out = self.out_channels
        # (B·Ho·Wo, O): a view for channels-last innovations, a copy otherwise.
        delta_mu = delta.delta_mu.permute(0, 2, 3, 1).reshape(-1, out)
        delta_var = delta.delta_var.permute(0, 2, 3, 1).reshape(-1, out)
        torch.mm(delta_mu.t(), self._patches, out=self.delta_mu_w.view(out, -1))
        torch.mm(delta_var.t(), self._patches_sq, out=self.delta_var_w.view(out, -1))
        if self.bias:
            torch.sum(delta_mu, 0, out=self.delta_mu_b)
            torch.sum(delta_var, 0, out=self.delta_var_b)

    def _conv_backward(self, delta: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor,
                       need_input_delta: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(convT(delta, weight), gW(inputs, delta), Σ delta) through torch's conv backward."""
        s, p = self.window.stride, self.window.native_padding
        return _conv_backward(delta, inputs, weight, [self.out_channels] if self.bias else None,
                              [s, s], [p, p], [1, 1], False, [0, 0], 1,
                              [need_input_delta, True, self.bias])

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = gW(m_A, δm), g_v = gW(m_A², δv) (and Σ δm, Σ δv for the bias) into the
        delta buffers; Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py)."""
        if self._mu_a is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        mu_w_sq = self._mu_w_sq if self._mu_w_sq is not None else self.mu_w * self.mu_w
        if self._patches is not None:
            self._backward_unfolded(delta)
            if not need_input_delta:
                return None
            # Only the transposed convolutions: the input tensor gives them its shape.
            s, p = self.window.stride, self.window.native_padding
            in_mu, in_var = (_conv_backward(d, self._mu_a, w, None, [s, s], [p, p], [1, 1],
                                            False, [0, 0], 1, [True, False, False])[0]
                             for d, w in ((delta.delta_mu, self.mu_w),
                                          (delta.delta_var, mu_w_sq)))
        else:
            assert self._mu_a_sq is not None
            in_mu, g_mu_w, g_mu_b = self._conv_backward(delta.delta_mu, self._mu_a, self.mu_w,
                                                        need_input_delta)
            in_var, g_var_w, g_var_b = self._conv_backward(delta.delta_var, self._mu_a_sq,
                                                           mu_w_sq, need_input_delta)
            # copy_ keeps the (flat-buffer) delta storage: views handed out stay live.
            self.delta_mu_w.copy_(g_mu_w)
            self.delta_var_w.copy_(g_var_w)
            if self.bias:
                self.delta_mu_b.copy_(g_mu_b)
                self.delta_var_b.copy_(g_var_b)
            if not need_input_delta:
                return None
        height, width = self._in_hw
        in_mu = self.window.crop(in_mu, height, width)
        in_var = self.window.crop(in_var, height, width)
        if self._jcb is not None:  # in place: both are fresh outputs of the kernel (or crop)
            in_mu.mul_(self._jcb)
            in_var.mul_(self._jcb).mul_(self._jcb)
        return DeltaStates(in_mu, in_var)

    def __repr__(self) -> str:
        extra = f", {self.window.describe()}"
        if not self.bias:
            extra += ", bias=False"
        if self.in_width:
            extra += f", in_width={self.in_width}, in_height={self.in_height}"
        return f"Conv2d({self.in_channels}, {self.out_channels}, {self.kernel_size}{extra})"
