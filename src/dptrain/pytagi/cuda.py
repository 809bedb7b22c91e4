"""pytagi.cuda on torch: what CUDA devices this process sees."""

from __future__ import annotations

import torch


def is_available() -> bool:
    return torch.cuda.is_available()


def is_nccl_available() -> bool:
    return torch.cuda.is_available() and torch.distributed.is_nccl_available()


def get_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def get_current_device() -> int:
    return torch.cuda.current_device()


def set_device(device_index: int) -> bool:
    torch.cuda.set_device(device_index)
    return True


def is_device_available(device_index: int) -> bool:
    return 0 <= device_index < get_device_count()


def get_device_properties(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index))


def get_device_memory(device_index: int) -> tuple[int, int]:
    """(free, total) bytes."""
    free, total = torch.cuda.mem_get_info(device_index)
    return int(free), int(total)
