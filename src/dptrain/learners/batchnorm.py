"""Global-batch BatchNorm on any device: torch's SyncBatchNorm on CUDA, `AllReduceBatchNorm`
elsewhere (torch's runs on CUDA only)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dptrain.runtime import all_reduce_flat, get_world_size, is_initialized


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, and the gradient summed over ranks too: every rank's loss depends on
    every rank's inputs through the global statistics."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        all_reduce_flat([out])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.detach().contiguous().clone()
        all_reduce_flat([out])
        return out


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch over all ranks.

    torch's `SyncBatchNorm` runs only on CUDA (`batch_norm_stats` has no CPU kernel and DDP
    rejects it on CPU modules), so `sync_batchnorm=True` installs this on other devices. In
    training mode with more than one rank, each forward all-reduces per channel (sum, sum of
    squares, count) in float64 and each backward all-reduces their gradients: two small
    collectives per layer per micro-batch, on every rank. Eval mode and a world of one behave as
    `BatchNorm`. Inputs: (N, C) or (N, C, *spatial). Same parameters and buffers as BatchNorm,
    so state dicts are interchangeable.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"AllReduceBatchNorm expects input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and is_initialized() and get_world_size() > 1):
            return super().forward(input)
        return _global_batch_norm(self, input, self._update_factor())

    def _update_factor(self) -> float:
        if not self.track_running_stats or self.num_batches_tracked is None:
            return 0.0
        self.num_batches_tracked.add_(1)
        return 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum


def _global_batch_norm(bn: AllReduceBatchNorm, x: torch.Tensor, factor: float) -> torch.Tensor:
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    shape = (1, c) + (1,) * (x.dim() - 2)
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()  # bf16 stats are too coarse
    count = torch.full((1,), float(x.numel() // c), dtype=torch.float64, device=x.device)
    stats = _AllReduceSum.apply(torch.cat([xf.sum(dims, dtype=torch.float64),
                                           (xf * xf).sum(dims, dtype=torch.float64), count]))
    n = stats[2 * c].item()
    if n <= 1:
        raise ValueError(f"BatchNorm needs more than 1 value per channel over all ranks when "
                         f"training, got {n:g}")
    mean = stats[:c] / n
    var = (stats[c:2 * c] / n - mean * mean).clamp_min(0.0)  # (C,) biased, float64
    y = (xf - mean.to(xf.dtype).view(shape)) * torch.rsqrt(var + bn.eps).to(xf.dtype).view(shape)
    if bn.affine:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            unbiased = var * (n / (n - 1))
            bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
    return y


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` with every BatchNorm computing global-batch statistics: torch's SyncBatchNorm on
    CUDA, `AllReduceBatchNorm` elsewhere. Parameters and buffers are reused, not copied."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm,
                                                                  AllReduceBatchNorm)):
        out = AllReduceBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, device))
    return out
