"""2-D convolution TAGI layer (docs/tagi.md, Conv2d), on torch's convolution kernels.

Shape legend: B batch, C input channels, O output channels, k kernel size, H, W input height
and width, Ho, Wo output height and width. Weights are (O, C, k, k) like torch's
`Conv2d.weight` and pytagi's flat `mu_w` (index ((o·C + c)·k + kh)·k + kw), biases (O,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptrain.tagi._conv import ConvLayer
from dptrain.tagi._spatial import channels_last, check_image
from dptrain.tagi.states import DeltaStates, HiddenStates

_conv_backward = torch.ops.aten.convolution_backward


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weightᵀ (+ bias): (N, K) x (O, K) -> (N, O)."""
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


class Conv2d(ConvLayer):
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
    What it shares with ConvTranspose2d (arguments, parameters, moments) is in `_conv`.
    """

    _transposed = False

    @property
    def _weight_shape(self) -> tuple[int, int, int, int]:
        k = self.kernel_size
        return (self.out_channels, self.in_channels, k, k)

    def _check_built_size(self, height: int, width: int) -> None:
        self.window.output_hw(repr(self), height, width)

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

        def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
            # (B, O, Ho, Wo); torch returns a 1-channel input's output in NCHW, hence the
            # conversion (a no-op otherwise).
            return channels_last(F.conv2d(x, weight, bias, stride, padding))

        mu_z, var_z, mu_a_sq, mu_w_sq = self._moments(conv, mu_a, var_a)
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
            in_mu, in_var = self._backward_kernels(delta.delta_mu, delta.delta_var, self._mu_a,
                                                   self._mu_a_sq, mu_w_sq, need_input_delta)
            if not need_input_delta:
                return None
        height, width = self._in_hw
        in_mu = self.window.crop(in_mu, height, width)
        in_var = self.window.crop(in_var, height, width)
        self._times_jacobian_(self._jcb, in_mu, in_var)
        return DeltaStates(in_mu, in_var)
