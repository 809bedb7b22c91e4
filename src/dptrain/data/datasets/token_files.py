"""`tokens:DIR`: pre-tokenized ids in DIR/train.bin, DIR/val.bin and optionally DIR/test.bin,
read a window at a time, never whole (`TokenFile`).

    split = load_tokens("data/shakespeare_char", block_size=64)

Two layouts of a .bin, told apart by content:
- nanoGPT's: the ids and nothing else (numpy's `tofile` of a uint16 array);
- llm.c's: a header of 256 little-endian int32 (magic, version, number of tokens), then the
  ids: magic 20240520 is uint16 (GPT-2's tokenizer), 20240801 uint32 (Llama 3's).

The vocabulary comes from DIR/meta.json (`{"vocab_size": 65, "dtype": "uint16"}`; dtype
uint16 or uint32) or nanoGPT's DIR/meta.pkl (a dict with vocab_size, itos, stoi, read by an
unpickler that refuses every global: a pickle from a stranger would otherwise run code); an
llm.c file without either has its tokenizer's size. Every id is checked below that size
once, chunk by chunk through a small buffer, so the check does not keep the file resident.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.data.datasets._files import existing_dir
from dptrain.data.datasets._safe_pickle import safe_loads_plain
from dptrain.data.datasets.base import Split
from dptrain.data.datasets.text import DEFAULT_BLOCK_SIZE
from dptrain.data.datasets.token_windows import TokenFile, TokenWindows
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.errors import ConfigError, DataError

HEADER_BYTES = 256 * 4
LLMC_FORMATS = {20240520: (np.dtype("<u2"), 50257), 20240801: (np.dtype("<u4"), 128256)}
"""llm.c's header magic -> (its ids' dtype, its tokenizer's vocabulary size)."""
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
CHECK_CHUNK = 1 << 20
"""Ids read at once by the check (2 MiB of uint16): a bounded transient whatever the file."""


@dataclass(frozen=True)
class _Meta:
    vocab_size: int | None
    dtype: np.dtype | None
    tokens: tuple[str, ...] | None
    where: str


def load_tokens(directory: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
                seed: int = 0, vocabulary: Vocabulary | None = None) -> Split:
    """DIR's train.bin / val.bin / test.bin as windows of `block_size` ids (module
    docstring); `seed` draws each training epoch's window offset. `vocabulary`: another run's
    (fine-tuning it), whose size the ids must have.

    Raises:
        DataError: a missing part or meta file, a size that is not whole ids, a header that
            does not match its file, an id not below the vocabulary size (file and position).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"--block-size: expected an integer >= 1, got {block_size!r}")
    root = existing_dir(directory, what="tokens")
    meta = _read_meta(root)
    paths = {part: root / f"{file}.bin" for part, file in
             (("train", "train"), ("validation", "val"), ("test", "test"))}
    for part in ("train", "validation"):
        if not paths[part].is_file():
            raise DataError(f"{paths[part]}: file not found (tokens:DIR needs train.bin and "
                            f"val.bin, test.bin is optional)")
    if not paths["test"].is_file():
        del paths["test"]
    files = {part: _open(path, meta) for part, path in paths.items()}
    vocab_size = meta.vocab_size or _llmc_vocab_size(files["train"], meta)
    if vocabulary is not None and (vocabulary.kind != "ids" or vocabulary.size != vocab_size):
        raise DataError(f"{root}: ids of a vocabulary of {vocab_size}, but the run's "
                        f"vocabulary is {vocabulary.kind} of {vocabulary.size}")
    digest = hashlib.sha256()
    for part, file in files.items():
        digest.update(f"{part}:{file.count}:".encode())
        _check_ids(file, vocab_size, digest)
    tokens = meta.tokens if meta.tokens is not None and len(meta.tokens) == vocab_size else None
    vocabulary = Vocabulary(kind="ids", size=vocab_size, tokens=tokens)
    name = f"tokens:{root.name}"
    windows = {part: TokenWindows(file, 0, file.count, block_size=block_size, seed=seed,
                                  shuffle_offset=part == "train", name=str(file.path))
               for part, file in files.items()}
    return Split(name=name, train=windows["train"], validation=windows["validation"],
                 # without a test.bin the test metrics are the validation part's
                 test=windows.get("test", windows["validation"]),
                 task="classification", num_classes=vocab_size, vocabulary=vocabulary,
                 fingerprint=digest.hexdigest())


def _read_meta(root: Path) -> _Meta:
    json_path, pkl_path = root / "meta.json", root / "meta.pkl"
    if json_path.is_file():
        return _meta_json(json_path)
    if pkl_path.is_file():
        return _meta_pkl(pkl_path)
    return _Meta(None, None, None, "")


def _meta_json(path: Path) -> _Meta:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a JSON file: {err}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected an object with vocab_size (and dtype), got "
                        f"{type(data).__name__}")
    unknown = sorted(set(data) - {"vocab_size", "dtype"})
    if unknown:
        raise DataError(f"{path}: unknown key(s) {unknown}; it takes vocab_size and dtype")
    dtype = data.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise DataError(f"{path}: dtype must be uint16 or uint32, got {dtype!r}")
    return _Meta(_vocab_size(data.get("vocab_size"), path), DTYPES[dtype], None, str(path))


def _meta_pkl(path: Path) -> _Meta:
    try:
        data = safe_loads_plain(path.read_bytes())
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
            AttributeError, IndexError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a plain pickle of nanoGPT's vocabulary (a dict of "
                        f"vocab_size, itos, stoi): {err}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a dict with vocab_size, got {type(data).__name__}")
    vocab_size = _vocab_size(data.get("vocab_size"), path)
    itos: Any = data.get("itos")
    tokens = None
    if isinstance(itos, dict) and all(isinstance(itos.get(i), str) for i in range(vocab_size)):
        tokens = tuple(itos[i] for i in range(vocab_size))
    return _Meta(vocab_size, DTYPES["uint16"], tokens, str(path))


def _vocab_size(value: Any, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{path}: vocab_size must be an integer >= 1, got {value!r}")
    return value


def _open(path: Path, meta: _Meta) -> TokenFile:
    """The ids of `path` as a TokenFile, its layout checked."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4") if size >= HEADER_BYTES \
            else np.zeros(0, dtype="<i4")
    if len(head) and int(head[0]) in LLMC_FORMATS:
        dtype = LLMC_FORMATS[int(head[0])][0]
        if meta.dtype is not None and meta.where.endswith(".json") and meta.dtype != dtype:
            raise DataError(f"{path}: its llm.c header says {dtype.name} ids, but "
                            f"{meta.where} says {meta.dtype.name}")
        count = int(head[2])
        if count < 0 or size - HEADER_BYTES != count * dtype.itemsize:
            raise DataError(f"{path}: its llm.c header says {count} tokens of "
                            f"{dtype.itemsize} bytes, but {size - HEADER_BYTES} bytes follow it")
        return TokenFile(path, dtype, HEADER_BYTES, count)
    if meta.dtype is None:
        raise DataError(f"{path.parent}: no meta.json or meta.pkl, and {path.name} has no "
                        f"llm.c header: the ids' type and the vocabulary size are unknown "
                        f"(write meta.json: {{\"vocab_size\": N, \"dtype\": \"uint16\"}})")
    dtype = meta.dtype
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.name} ids "
                        f"({dtype.itemsize} bytes each)")
    return TokenFile(path, dtype, 0, size // dtype.itemsize)


def _llmc_vocab_size(train: TokenFile, meta: _Meta) -> int:
    # reached only without a meta file, where every part has an llm.c header (else _open
    # refused it); the training part's format names the tokenizer
    with open(train.path, "rb") as f:
        magic = int(np.frombuffer(f.read(4), dtype="<i4")[0])
    return LLMC_FORMATS[magic][1]


def _check_ids(file: TokenFile, vocab_size: int, digest: Any) -> None:
    """Every id of `file` below `vocab_size`, read a chunk at a time (and hashed into
    `digest`).

    Raises:
        DataError: the first id that is not, with its position.
    """
    with open(file.path, "rb") as f:
        f.seek(file.offset)
        position = 0
        while position < file.count:
            chunk = np.fromfile(f, dtype=file.dtype, count=min(CHECK_CHUNK,
                                                               file.count - position))
            if not len(chunk):
                raise DataError(f"{file.path}: ended after {position} of {file.count} ids")
            digest.update(chunk.tobytes())
            bad = chunk >= vocab_size
            if bad.any():
                at = int(np.argmax(bad))
                raise DataError(f"{file.path}: id {int(chunk[at])} at position "
                                f"{position + at} is not below the vocabulary size "
                                f"{vocab_size} ({int(bad.sum())} such id(s) in that stretch)")
            position += len(chunk)
