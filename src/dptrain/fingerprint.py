"""`params_sha256`: one fingerprint of named tensors, for exact comparisons of runs."""

from __future__ import annotations

import hashlib

import torch


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """Fingerprint of named tensors (names, dtypes, shapes and bytes), for exact comparisons."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
