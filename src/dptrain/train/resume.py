"""Whether a run directory may be resumed by this run: one run per directory.

A checkpoint carries the record of the run that wrote it (the options that define the run, the
model's parameter layout). Resuming compares that record with this run's before anything is
loaded, and refuses a difference in one line that names each option with both values. Pure
functions of plain values, so tests call them without processes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dptrain.errors import CheckpointError

LAYOUT_KEY = "parameter_layout"
"""The model's parameter names, shapes and dtypes: compared only when nothing else differs (a
changed --hidden is clearer named as such than as a changed layout)."""


def parameter_layout(state: Mapping[str, torch.Tensor]) -> str:
    """A short fingerprint of the names, dtypes and shapes (not the values) of a state dict."""
    text = ";".join(f"{name}|{t.dtype}|{tuple(t.shape)}" for name, t in sorted(state.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def as_json(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record as it reads back from meta.json (tuples become lists, keys strings)."""
    return json.loads(json.dumps(dict(record), sort_keys=True, default=str))


_MISSING = object()


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(unset)"
    return json.dumps(value) if isinstance(value, str) and (not value or " " in value) \
        else str(value)


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`name old -> new` for each key whose values differ; the layout only if nothing else."""
    saved, current = as_json(saved), as_json(current)
    found = []
    for name in sorted((set(saved) | set(current)) - {LAYOUT_KEY}):
        old, new = saved.get(name, _MISSING), current.get(name, _MISSING)
        if old != new:
            found.append(f"{name.replace('_', '-')} {_shown(old)} -> {_shown(new)}")
    old, new = saved.get(LAYOUT_KEY, _MISSING), current.get(LAYOUT_KEY, _MISSING)
    if not found and _MISSING not in (old, new) and old != new:
        found.append(f"model parameters (names, shapes, dtypes) {old} -> {new}")
    return found


def check_same_run(run_dir: Path, checkpoint: Path, saved: Mapping[str, Any] | None,
                   current: Mapping[str, Any]) -> None:
    """Raise `CheckpointError` when `checkpoint` was written by a run with another record."""
    if saved is None:
        return  # format 1 wrote no record: nothing to compare (the learner checks shapes)
    diffs = differences(saved, current)
    if diffs:
        raise CheckpointError(
            f"{run_dir} was started with different options: {', '.join(diffs)} (checkpoint "
            f"{checkpoint.name}); resume with the same options, or start afresh with a new "
            f"--out")


def refuse_never(run_dir: Path, newest: Path) -> CheckpointError:
    """The error for `resume="never"` in a directory that already holds checkpoints."""
    return CheckpointError(
        f"{run_dir} holds checkpoints (newest: {newest}) and --resume never would mix two runs "
        f"in it; start afresh with a new --out (nothing was deleted), or resume with --resume "
        f"auto")
