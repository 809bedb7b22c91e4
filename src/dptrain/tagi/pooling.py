"""Pooling layers (docs/tagi.md, AvgPool2d): fixed maps of the image states, no parameters.

Shape legend: B batch, C channels, H, W input height and width, Ho, Wo output height and width.
Padding follows pytagi's `padding_type` (see `_spatial`); pooling pads explicitly, so any
padding works, not only torch's "at most half the kernel".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptrain.tagi._spatial import Window, channels_last, check_image
from dptrain.tagi.base import Layer
from dptrain.tagi.states import DeltaStates, HiddenStates

_avg_pool_backward = torch.ops.aten.avg_pool2d_backward


class _Pool2d(Layer):
    """What both pools share: the window, the input check, and the stored input J."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.kernel_size, self.stride = window.kernel, window.stride
        self.padding, self.padding_type = window.padding, window.padding_type
        super().__init__()
        self.clear_cache()

    def clear_cache(self) -> None:
        self._jcb: torch.Tensor | None = None  # (B, C, H, W) J of the input, None = 1
        self._in_hw: tuple[int, int] | None = None  # (H, W) of the last training input

    def _check(self, states: HiddenStates) -> None:
        check_image(self.label, states.mu_a)
        mu_a = states.mu_a
        self.window.output_hw(self.label, mu_a.shape[2], mu_a.shape[3], mu_a.shape)

    def _remember(self, states: HiddenStates) -> None:
        self._jcb = states.jcb
        self._in_hw = (states.mu_a.shape[2], states.mu_a.shape[3])

    def _to_input(self, delta_mu: torch.Tensor, delta_var: torch.Tensor) -> DeltaStates:
        """Innovations for the padded input → for the previous Z: crop, then J, J²."""
        height, width = self._in_hw
        delta_mu = self.window.crop_all(delta_mu, height, width)
        delta_var = self.window.crop_all(delta_var, height, width)
        if self._jcb is not None:  # in place: both are fresh (the kernel's output or a crop)
            delta_mu.mul_(self._jcb)
            delta_var.mul_(self._jcb).mul_(self._jcb)
        return DeltaStates(delta_mu, delta_var)

    def _need_forward(self) -> None:
        if self._in_hw is None:
            raise RuntimeError(f"{self.label}: backward() needs a forward in training mode first")

    def __repr__(self) -> str:
        extra = ""
        if self.padding:
            extra = f", padding={self.padding}, padding_type={self.padding_type}"
        return f"{type(self).__name__}({self.kernel_size}, stride={self.stride}{extra})"


class AvgPool2d(_Pool2d):
    """Mean over each k×k window: m = Σ m_A / k², v = Σ v_A / k⁴ (padding counts as zeros).

    A fixed linear map, so the moments are exact; the innovations go back through its
    transpose: δm_in = J ⊙ Σ_{windows ∋ input} δm / k², δv_in = J² ⊙ Σ δv / k⁴.
    `stride=None` (or pytagi's default -1) means `stride = kernel_size`.

    The forward runs as a depthwise convolution with a constant 1/k² kernel (on the CPU several
    times faster than `avg_pool2d`), the backward as `avg_pool2d`'s backward (faster than the
    convolution's).
    """

    def __init__(self, kernel_size: int, stride: int | None = None, padding: int = 0,
                 padding_type: int = 0) -> None:
        if stride is None or stride == -1:
            stride = kernel_size
        super().__init__(Window.checked("AvgPool2d", kernel_size, stride, padding, padding_type))
        self._kernel: torch.Tensor | None = None  # (C, 1, k, k) filled with 1/k²

    def clear_cache(self) -> None:
        super().clear_cache()
        self._padded: torch.Tensor | None = None  # (B, C, H + P, W + P), for its shape

    def _averaging_kernel(self, like: torch.Tensor) -> torch.Tensor:
        channels, k = like.shape[1], self.kernel_size
        kernel = self._kernel
        if (kernel is None or kernel.shape[0] != channels or kernel.dtype != like.dtype
                or kernel.device != like.device):
            kernel = torch.full((channels, 1, k, k), 1.0 / (k * k), dtype=like.dtype,
                                device=like.device)
            self._kernel = kernel
        return kernel

    def forward(self, states: HiddenStates) -> HiddenStates:
        self._check(states)
        # Channels-last (see _spatial): the backward kernel is ~5x faster on it than on NCHW.
        mu_a = channels_last(self.window.pad_all(states.mu_a))  # (B, C, H + P, W + P)
        kernel = self._averaging_kernel(mu_a)
        channels, k, s = mu_a.shape[1], self.kernel_size, self.stride
        mu_z = F.conv2d(mu_a, kernel, None, s, 0, 1, channels)  # (B, C, Ho, Wo)
        var_z = None
        if states.var_a is not None:
            var_a = channels_last(self.window.pad_all(states.var_a))
            var_z = F.conv2d(var_a, kernel, None, s, 0, 1, channels).mul_(1.0 / (k * k))
        if self.training:
            self._remember(states)
            self._padded = mu_a
        return HiddenStates(mu_z, var_z, None)

    def _transpose(self, delta: torch.Tensor) -> torch.Tensor:
        """Σ over the windows holding each (padded) input of delta / k²: avg_pool2d's
        vector-Jacobian product (faster here than the depthwise convolution's)."""
        k, s = self.kernel_size, self.stride
        return _avg_pool_backward(channels_last(delta), self._padded, [k, k], [s, s], [0, 0],
                                  False, True, None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        self._need_forward()
        if not need_input_delta:
            return None
        k = self.kernel_size
        return self._to_input(self._transpose(delta.delta_mu),
                              self._transpose(delta.delta_var).mul_(1.0 / (k * k)))


class MaxPool2d(_Pool2d):
    """Per window, the input with the largest mean (the true maximum, negative for a window of
    negative means; cuTAGI's loop starts at -1e9, see docs/tagi.md, Departures from pytagi):
    the output takes that input's mean and variance, and the innovations go back to it (summed
    where overlapping windows pick the same input; J, J² of the input applied). Padded
    positions never win.

    pytagi's defaults: `stride=1`. The padding must be smaller than the kernel, so that every
    window holds at least one pixel. Ties go to the first maximum in raster order, as in cuTAGI.
    """

    def __init__(self, kernel_size: int, stride: int = 1, padding: int = 0,
                 padding_type: int = 0) -> None:
        window = Window.checked("MaxPool2d", kernel_size, stride, padding, padding_type)
        if padding >= kernel_size:
            raise ValueError(f"MaxPool2d: padding {padding} must be smaller than the kernel "
                             f"{kernel_size} (a window of padding only has no maximum)")
        super().__init__(window)

    def clear_cache(self) -> None:
        super().clear_cache()
        self._argmax: torch.Tensor | None = None  # (B, C, Ho·Wo) flat index into the padded plane
        self._padded_hw: tuple[int, int] = (0, 0)

    def forward(self, states: HiddenStates) -> HiddenStates:
        self._check(states)
        mu_a = self.window.pad_all(states.mu_a, float("-inf"))
        mu_z, argmax = F.max_pool2d(mu_a, self.kernel_size, self.stride, return_indices=True)
        var_z = None
        flat_idx = argmax.flatten(2)  # (B, C, Ho·Wo)
        if states.var_a is not None:
            var_a = self.window.pad_all(states.var_a).flatten(2)  # (B, C, (H+P)·(W+P))
            var_z = var_a.gather(2, flat_idx).view_as(mu_z)
        if self.training:
            self._remember(states)
            self._argmax = flat_idx
            self._padded_hw = (mu_a.shape[2], mu_a.shape[3])
        return HiddenStates(mu_z, var_z, None)

    def backward(self, delta: DeltaStates, need_input_delta: bool) -> DeltaStates | None:
        self._need_forward()
        if not need_input_delta:
            return None
        height, width = self._padded_hw

        def route(d: torch.Tensor) -> torch.Tensor:
            plane = d.new_zeros(d.shape[0], d.shape[1], height * width)
            return plane.scatter_add_(2, self._argmax, d.flatten(2)).view(
                d.shape[0], d.shape[1], height, width)

        return self._to_input(route(delta.delta_mu), route(delta.delta_var))
