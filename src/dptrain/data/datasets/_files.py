"""Finding and reading dataset files, with errors that name the file."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence
from pathlib import Path

from dptrain.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | Path) -> bytes:
    """The file's bytes, decompressed when it is gzip (recognised by content, not by name)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err}") from None
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:
        raise DataError(f"{path}: corrupt or truncated gzip file: {err}") from None


def find_file(directories: Sequence[Path], names: Sequence[str], *, what: str) -> Path:
    """The first `directory / name` that exists, trying names in order within each directory.

    Raises:
        DataError: none exists; the message lists every path tried.
    """
    tried = [d / n for d in directories for n in names]
    for path in tried:
        if path.is_file():
            return path
    listing = "\n  ".join(str(p) for p in tried)
    raise DataError(f"{what}: file not found; looked for:\n  {listing}")


def existing_dir(directory: str | Path, *, what: str) -> Path:
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise DataError(f"{path}: {what} directory not found")
    return path
