"""Atomic, checksummed checkpoints: a good checkpoint is never replaced by a partial one.

Layout of a run directory's `checkpoints/`:

    step-00000120/state.pt     torch.save of the state (tensors and plain Python values only)
    step-00000120/meta.json    written last: sha256 of every other file, step, epoch, world
                               size, config, the run's record (options that define the run)
    step-00000120/sharded/     (sharded learners only) the learner's own distributed checkpoint
    best/                      a copy of the best checkpoint by the monitored metric

A save goes to `step-N.tmp/`, fsyncs every file, renames the folder to `step-N` and fsyncs
the parent: a crash at any point leaves either no `step-N` or a complete one. `meta.json` is the
completion marker; a folder without it, or with any file that fails its checksum (a shard of a
sharded checkpoint too), is reported and skipped in favour of the previous one.

Every rank writes its shards of a sharded checkpoint into the same folder, and every rank reads
them back from it: sharded checkpoints need a run directory on a filesystem all nodes share
(replicated ones do not; see `dptrain.train.resume.find_newest`). A sharded checkpoint directory is trusted
input: the checksums catch corruption, not tampering, and torch's distributed-checkpoint loader
unpickles its `.metadata` file. Load only checkpoints your own runs wrote. (`state.pt` is read with `weights_only=True` and executes no code.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptrain.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: meta.json holds a sha256 per file (`files`); 1 (still read): of state.pt only."""
READABLE_VERSIONS = (1, 2)
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, Any]

    def load_state(self) -> dict[str, Any]:
        """The saved state; never executes pickled code (`weights_only=True`)."""
        return torch.load(self.path / "state.pt", map_location="cpu", weights_only=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath, name))
        _fsync_dir(Path(dirpath))


def begin(directory: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of `step` (rank 0 calls this)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"step-{step:08d}.tmp"  # one name every rank can compute (sharded saves)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, state: dict[str, Any], meta: dict[str, Any], *,
           midway: Callable[[], None] | None = None) -> Path:
    """Write `state` and `meta` into `tmp` and atomically publish it as `step-N`.

    `midway` runs between the state and the completion marker (fault injection kills there).
    """
    torch.save(state, tmp / "state.pt")
    if midway is not None:
        midway()
    meta = {**meta, "format_version": FORMAT_VERSION, "files": _file_digests(tmp)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    _fsync_tree(tmp)
    # An existing step-N is a re-run of the same step after a restart: replaced only now.
    return _publish(tmp, tmp.with_name(f"step-{meta['step']:08d}"))


def _publish(tmp: Path, final: Path) -> Path:
    """Rename the complete folder `tmp` to `final`, replacing any folder there, so that at every
    moment `final` is either the old complete folder or the new one (never a mix); the old one
    stays on disk under `*.old-PID` for the instant between the two renames."""
    if final.exists():
        old = final.with_name(final.name + f".old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)
    return final


def _file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` but meta.json, by POSIX path relative to `root`."""
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p != root / "meta.json"}


def validate(path: Path) -> Checkpoint:
    """The checkpoint at `path`, or `CheckpointError` saying what is wrong with it."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path}: unreadable ({err})") from err
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {version!r}, this dptrain reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    expected = meta.get("files") if version >= 2 else {"state.pt": meta.get("sha256")}
    if not isinstance(expected, dict) or "state.pt" not in expected:
        raise CheckpointError(f"{meta_path}: lists no checksums")
    for name, digest in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        actual = _sha256(file)
        if actual != digest:
            raise CheckpointError(f"{file}: checksum mismatch (expected {digest}, got "
                                  f"{actual}): the file is corrupt")
    return Checkpoint(path=path, step=int(meta["step"]), meta=meta)


def list_steps(directory: Path) -> list[Path]:
    """Published step folders, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_valid(directory: Path) -> Checkpoint | None:
    """The newest checkpoint that passes validation; broken ones are logged and skipped."""
    for path in list_steps(directory):
        try:
            return validate(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err)
    return None


def sharded_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a sharded (FSDP) checkpoint, whatever world size wrote it,
    read in this one process (torch.distributed.checkpoint)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        try:
            dcp_to_torch_save(directory, target)
            state = torch.load(target, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - DCP raises many kinds; named in one line
            raise CheckpointError(f"{directory}: the sharded checkpoint cannot be read "
                                  f"({type(err).__name__}: {err})") from err
    return {name: t for name, t in state["model"].items() if isinstance(t, torch.Tensor)}


def find(run_dir: Path, which: str = "best") -> Checkpoint:
    """The checkpoint of a run directory: `which` = "best" (the best checkpoint if the run kept
    one, else the last) or "last"."""
    if which not in ("best", "last"):
        raise CheckpointError(f"which checkpoint: expected 'best' or 'last', got {which!r}")
    directory = run_dir / "checkpoints"
    if which == "best" and (directory / "best").is_dir():
        return validate(directory / "best")
    found = latest_valid(directory)
    if found is None:
        raise CheckpointError(f"{run_dir}: no valid checkpoint in {directory} (is this a run "
                              f"directory of dptrain train?)")
    return found


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` published checkpoints and stale temp folders."""
    for path in list_steps(directory)[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in [*directory.glob("step-*.tmp"), *directory.glob("*.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def copy_as_best(source: Path, directory: Path) -> None:
    """Atomically replace `best/` with a copy of `source`."""
    tmp = directory / f"best.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    _fsync_tree(tmp)
    _publish(tmp, directory / "best")
