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

from dptrain.tagi._conv import ConvLayer
from dptrain.tagi._spatial import channels_last
from dptrain.tagi.states import DeltaStates, HiddenStates


class ConvTranspose2d(ConvLayer):
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
    What it shares with Conv2d (arguments, parameters, moments) is in `_conv`.
    """

    _transposed = True

    @property
    def _weight_shape(self) -> tuple[int, int, int, int]:
        k = self.kernel_size
        return (self.in_channels, self.out_channels, k, k)

    def _check_built_size(self, height: int, width: int) -> None:
        self.output_hw(type(self).__name__, height, width)

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
        mu_z, var_z, mu_a_sq, mu_w_sq = self._moments(self._convT, mu_a, var_a)
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

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        """Writes g_m = gW(m_A, δm), g_v = gW(m_A², δv) (and Σ δm, Σ δv for the bias) into the
        delta buffers; Δ = v g_m, v² g_v follows in `scale_deltas_` (base.py)."""
        if self._mu_a is None or self._mu_a_sq is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")
        mu_w_sq = self._mu_w_sq if self._mu_w_sq is not None else self.mu_w * self.mu_w
        in_mu, in_var = self._backward_kernels(
            self._uncrop(delta.delta_mu), self._uncrop(delta.delta_var), self._mu_a,
            self._mu_a_sq, mu_w_sq, need_input_delta)
        if not need_input_delta:
            return None
        self._times_jacobian_(self._jcb, in_mu, in_var)
        # The innovations have the shape of the state they belong to (flat after a Linear).
        return DeltaStates(in_mu.reshape(self._in_shape), in_var.reshape(self._in_shape))
