"""Which checkpoint a run resumes from, and whether it may: one run per directory.

A checkpoint carries the record of the run that wrote it (the options that define the run, the
model's parameter layout). Resuming compares that record with this run's before anything is
loaded, and refuses a difference in one line that names each option with both values. The
record functions are pure, so tests call them without processes; `find_newest` negotiates
between the nodes which checkpoint every rank loads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain import runtime as dd
from dptrain.errors import CheckpointError
from dptrain.train import checkpoint as ckpt
from dptrain.train.options import BEFORE_OPTION, RUN_DEFAULTS, zero_as_unset

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
    """`name old -> new` for each key whose values differ; the layout only if nothing else.
    An option the saved record lacks (it was written before the option existed) matches its
    default, or the value meaning what dptrain did before it (`BEFORE_OPTION`); an option
    saved as 0 that is now unset as None reads as None (`zero_as_unset`): upgrading dptrain
    does not strand a run."""
    saved, current = as_json(zero_as_unset(saved)), as_json(current)
    defaults = as_json({**RUN_DEFAULTS, **BEFORE_OPTION})
    found = []
    for name in sorted((set(saved) | set(current)) - {LAYOUT_KEY}):
        old, new = saved.get(name, defaults.get(name, _MISSING)), current.get(name, _MISSING)
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


def saved_record(ckpt_dir: Path) -> dict[str, Any] | None:
    """The run record of the newest step folder here whose meta.json reads (one run per
    directory: every checkpoint of it holds the same), or None; no checksum is verified."""
    for path in ckpt.list_steps(ckpt_dir):
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("run_record"), dict):
            return meta["run_record"]
    return None


def any_saved_record(ckpt_dir: Path, local_rank: int) -> dict[str, Any] | None:
    """Collective: a saved run record any node holds (each node's first rank reads its own
    run directory: no shared filesystem needed), the same on every rank."""
    held = dd.all_gather_object(saved_record(ckpt_dir) if local_rank == 0 else None)
    return next((record for record in held if record is not None), None)


# ------------------------------------------------------------------------ finding the checkpoint
def _newest_listed(ckpt_dir: Path, local_rank: int) -> tuple[int, str] | None:
    """(step, path) of this node's newest step folder, valid or not (first local rank)."""
    if local_rank != 0:
        return None
    listed = ckpt.list_steps(ckpt_dir)
    return None if not listed else (int(listed[0].name.split("-")[1]), str(listed[0]))


def refuse_if_any(run_dir: Path, ckpt_dir: Path, local_rank: int) -> None:
    """Collective: raise `refuse_never` on every rank when any node holds a checkpoint."""
    held = [h for h in dd.all_gather_object(_newest_listed(ckpt_dir, local_rank))
            if h is not None]
    if held:
        raise refuse_never(run_dir, Path(max(held)[1]))


@dataclass(frozen=True)
class Found:
    """The checkpoint a run resumes from, the same on every rank."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]


def find_newest(run_dir: Path, ckpt_dir: Path, *, rank: int, local_rank: int,
                record: Mapping[str, Any]) -> Found | None:
    """The newest valid checkpoint any node holds, read by the rank that holds it and given to
    every rank; None when no node holds one. Collective.

    No shared filesystem is needed: the first rank of every node reports the newest valid
    checkpoint in its own run directory, the newest wins (a restarted job's rank 0 may sit on
    another node than the one that wrote it; on a tie the lowest rank), and its holder reads
    and broadcasts it. A checkpoint of another run (`record` differs) is refused on every rank
    alike, before anything is loaded, so nobody waits for a rank that raised.
    """
    found = ckpt.latest_valid(ckpt_dir) if local_rank == 0 else None
    offers = dd.all_gather_object(None if found is None else found.step)
    ranked = [(step, -r) for r, step in enumerate(offers) if step is not None]
    if not ranked:
        return None
    holder = -max(ranked)[1]
    meta, path = dd.broadcast_object(
        (found.meta, str(found.path)) if rank == holder else None, src=holder)
    path = Path(path)
    check_same_run(run_dir, path, meta.get("run_record"), record)
    loaded: tuple[str, Any] | None = None
    if rank == holder:
        try:
            loaded = ("ok", found.load_state())
        except Exception as err:  # noqa: BLE001 - told to every rank, then raised there
            loaded = ("error", f"{path}/state.pt: cannot be loaded ({err})")
    status, state = dd.broadcast_object(loaded, src=holder)
    if status != "ok":
        raise CheckpointError(state)
    return Found(path, meta, state)


def partial_sums(saved: list[dict[str, Any]] | None, rank: int, world_size: int
                 ) -> dict[str, tuple[float, float]]:
    """This rank's share of a mid-epoch checkpoint's metric sums (`(sum, count)` per metric,
    one dict per saved rank): rank r's own on the same world size, so the epoch's sums come out
    bit-identical; on another world size, all of them on rank 0 and none elsewhere. The sums are
    additive, so the resumed epoch's metrics equal the uninterrupted run's up to float
    summation order."""
    if not saved:
        return {}
    if len(saved) == world_size:
        return {name: (float(s), float(c)) for name, (s, c) in saved[rank].items()}
    if rank != 0:
        return {}
    total: dict[str, tuple[float, float]] = {}
    for part in saved:
        for name, (s, c) in part.items():
            old_s, old_c = total.get(name, (0.0, 0.0))
            total[name] = (old_s + s, old_c + c)
    return total
