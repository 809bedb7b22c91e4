"""Sliding windows of the image layers (Conv2d, AvgPool2d, MaxPool2d): padding and output size.

pytagi's `padding_type` (cuTAGI `get_padded_image_dim`): 1 pads `padding` zeros on every side
(torch semantics); 2 pads only on the right and bottom (the image stays at the top-left corner);
any other value means no padding, and pytagi then leaves its padded-image geometry undefined, so
`padding > 0` with such a type is refused here. Output size per dimension, pytagi's rule:
`(size − kernel + P) / stride + 1` with P = 2p (type 1), p (type 2), where the division must be
exact (pytagi throws otherwise; torch would silently drop the last rows and columns).

Image states are kept channels-last (NHWC in memory, still indexed (B, C, H, W)): torch's CPU
convolution and pooling kernels run much faster on it, elementwise ops keep the layout, and
`flatten` (a Linear after the conv stack) still reads channel-major. `channels_last` converts a
state at the entry of each image layer; it is a no-op for a state that already is.

Torch's kernels take only symmetric padding, so type 2 pads the input explicitly
(`F.pad(x, (0, p, 0, p))`) and runs the kernel unpadded; the innovations for the padded input
are cropped back to the image. Shape legend: B batch, C channels, H, W height and width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def channels_last(x: torch.Tensor | None) -> torch.Tensor | None:
    """x (B, C, H, W) laid out channels-last (unchanged if it already is, or None)."""
    return None if x is None else x.contiguous(memory_format=torch.channels_last)


def positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Window:
    """A square k×k window moved by `stride`, with pytagi's padding convention."""

    kernel: int
    stride: int
    padding: int
    padding_type: int

    @classmethod
    def checked(cls, owner: str, kernel: int, stride: int, padding: int,
                padding_type: int) -> Window:
        """Validate the hyper-parameters; `owner` names the layer in the error."""
        positive_int(owner, "kernel_size", kernel)
        positive_int(owner, "stride", stride)
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"{owner}: padding must be an int >= 0, got {padding!r}")
        if padding_type not in (0, 1, 2):
            raise ValueError(f"{owner}: padding_type must be 0 (none), 1 (every side) or 2 "
                             f"(right and bottom only), got {padding_type!r}")
        if padding > 0 and padding_type == 0:
            raise ValueError(f"{owner}: padding={padding} needs padding_type 1 (every side) or "
                             f"2 (right and bottom); padding_type 0 means no padding")
        return cls(kernel, stride, padding, padding_type)

    @property
    def total_padding(self) -> int:
        """P of the output-size rule: zeros added along one dimension."""
        if self.padding_type == 1:
            return 2 * self.padding
        return self.padding if self.padding_type == 2 else 0

    @property
    def native_padding(self) -> int:
        """The symmetric padding handed to torch's kernel (type 2 pads explicitly instead)."""
        return self.padding if self.padding_type == 1 else 0

    @property
    def pads_explicitly(self) -> bool:
        return self.padding_type == 2 and self.padding > 0

    def output_size(self, owner: str, size: int, what: str, shape: str = "") -> int:
        """Output length along one dimension of length `size`, or a ValueError naming why
        (`shape`, e.g. " (input of shape (2, 1, 5, 5))", is appended to the message)."""
        span = size - self.kernel + self.total_padding
        if span < 0:
            raise ValueError(f"{owner}: the {what} {size} (+ padding {self.total_padding}) is "
                             f"smaller than the kernel {self.kernel}{shape}")
        if span % self.stride:
            raise ValueError(f"{owner}: {what} {size} does not fit: ({what} − kernel + padding) "
                             f"= {span} is not a multiple of the stride {self.stride}{shape}")
        return span // self.stride + 1

    def output_hw(self, owner: str, height: int, width: int,
                  shape: tuple[int, ...] | None = None) -> tuple[int, int]:
        """(Ho, Wo) for an input of `height` x `width`; `shape` is the whole input's, for the
        error message."""
        where = f" (input of shape {tuple(shape)})" if shape is not None else ""
        return (self.output_size(owner, height, "input height", where),
                self.output_size(owner, width, "input width", where))

    def pad(self, x: torch.Tensor | None, value: float = 0.0) -> torch.Tensor | None:
        """x (B, C, H, W) padded on the right and bottom for type 2; unchanged otherwise."""
        if x is None or not self.pads_explicitly:
            return x
        p = self.padding
        return F.pad(x, (0, p, 0, p), value=value)

    def crop(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Innovations for the padded input (B, C, H+p, W+p) cut back to the image (B, C, H, W)."""
        if not self.pads_explicitly:
            return x
        return x[:, :, :height, :width].contiguous(memory_format=torch.channels_last)

    def pad_all(self, x: torch.Tensor | None, value: float = 0.0) -> torch.Tensor | None:
        """x (B, C, H, W) with every padded position made explicit (for pooling kernels, whose
        own padding is limited to half the kernel): (B, C, H + P, W + P)."""
        if x is None or not self.padding:
            return x
        p = self.padding
        pads = (p, p, p, p) if self.padding_type == 1 else (0, p, 0, p)
        return F.pad(x, pads, value=value)

    def crop_all(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Innovations for the input padded by `pad_all` cut back to the image (B, C, H, W)."""
        if not self.padding:
            return x
        top = self.padding if self.padding_type == 1 else 0
        return x[:, :, top:top + height, top:top + width].contiguous(
            memory_format=torch.channels_last)

    def describe(self) -> str:
        """The non-default arguments, for a layer's repr."""
        parts = [f"stride={self.stride}"]
        if self.padding:
            parts += [f"padding={self.padding}", f"padding_type={self.padding_type}"]
        return ", ".join(parts)


def check_image(owner: str, x: torch.Tensor, channels: int | None = None,
                hw: tuple[int, int] | None = None) -> None:
    """x must be (B, C, H, W), with C = `channels` and (H, W) = `hw` when given."""
    want = (f"(batch, {channels or 'C'}, "
            + (f"{hw[0]}, {hw[1]})" if hw else "height, width)"))
    if x.dim() != 4:
        raise ValueError(f"{owner}: expected an image input {want}, got shape {tuple(x.shape)}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{owner}: expected {channels} input channels {want}, got input of "
                         f"shape {tuple(x.shape)}")
    if hw is not None and tuple(x.shape[2:]) != tuple(hw):
        raise ValueError(f"{owner}: built for {hw[0]}x{hw[1]} images (in_height x in_width), "
                         f"expected {want}, got input of shape {tuple(x.shape)}")
