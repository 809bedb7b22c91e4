"""`text:PATH`: a UTF-8 text (a file, or a folder of *.txt read in name order) as windows of
character or byte ids.

    split = load_text("input.txt", val_size="0.1", block_size=64)
    split.vocabulary          # the training part's characters, plus one unknown id
    split.train[0]            # (x, y): 64 ids and the same shifted by one

The text is split by position: the training part first, then the validation part, then the
test part (none unless asked). A fraction f of a text of n tokens takes its last
n - floor((1 - f) n) tokens, so `--val-size 0.1` trains on the first floor(0.9 n) characters,
nanoGPT's 90/10. The character vocabulary is the training part's: a character met only in
validation or test maps to the unknown id and is counted (`Split.unknown_tokens`).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from dptrain.data.datasets.base import Split
from dptrain.data.datasets.sizes import parse_size
from dptrain.data.datasets.token_windows import TokenArray, TokenWindows
from dptrain.data.datasets.vocabulary import Vocabulary
from dptrain.errors import ConfigError, DataError

DEFAULT_VAL_FRACTION = 0.1
"""A text's validation part when --val-size is auto: its last tenth (nanoGPT's 90/10)."""
DEFAULT_BLOCK_SIZE = 64
"""Tokens a window shows the model, when not given (nanoGPT's CPU Shakespeare model)."""
TOKENIZERS = ("char", "byte")


def read_text(path: str | Path) -> tuple[str, bytes]:
    """The text of a file, or of a folder's *.txt files in name order joined as they are, and
    its raw bytes.

    Raises:
        DataError: no such file or folder, a folder without *.txt, a file that is not UTF-8
            (named, with the byte offset), or a text that is empty or only whitespace.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted((p for p in path.glob("*.txt") if p.is_file()), key=lambda p: p.name)
        if not files:
            raise DataError(f"{path}: no *.txt file in this folder")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"{path}: no such file or folder")
    texts, raw = [], []
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as err:
            raise DataError(f"{file}: cannot read: {err.strerror or err}") from None
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{file}: not UTF-8 text: byte {err.start} "
                            f"(0x{data[err.start]:02x}) {err.reason}") from None
        raw.append(data)
    text = "".join(texts)
    if not text.strip():
        what = "empty" if not text else "only whitespace"
        raise DataError(f"{path}: the text is {what}: there is nothing to learn from")
    return text, b"".join(raw)


def part_sizes(num_tokens: int, *, val_size: str | int | float | None,
               test_size: str | int | float | None, where: str) -> tuple[int, int]:
    """(train_end, val_end) of a text of `num_tokens`: train [0, train_end), validation
    [train_end, val_end), test [val_end, num_tokens). A count is tokens; a fraction f takes
    n - floor((1 - f) n); auto: validation 0.1, no test part.

    Raises:
        ConfigError: a size that does not parse. DataError: parts that leave nothing to train.
    """
    val = parse_size(val_size, option="val-size")
    test = parse_size(test_size, option="test-size")

    def tokens(size: int | float) -> int:
        if isinstance(size, int):
            return size
        # rounded first: 0.9 * n may land a hair below a whole number
        return num_tokens - math.floor(round((1 - size) * num_tokens, 6))

    val_tokens = tokens(DEFAULT_VAL_FRACTION if val is None else val)
    test_tokens = 0 if test is None else tokens(test)
    if val_tokens + test_tokens >= num_tokens:
        raise DataError(f"{where}: --val-size ({val_tokens} tokens) and --test-size "
                        f"({test_tokens}) take the whole text of {num_tokens} tokens: nothing "
                        f"is left to train on")
    val_end = num_tokens - test_tokens
    return val_end - val_tokens, val_end


def load_text(path: str, *, tokenizer: str = "char", val_size: str | None = None,
              test_size: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
              seed: int = 0, vocabulary: Vocabulary | None = None) -> Split:
    """The text at `path` as windows of `block_size` ids (module docstring). `seed` draws
    each training epoch's window offset. `vocabulary`: another run's, which the text must keep
    to (fine-tuning that run: its ids are the model's), instead of the training part's.

    Raises:
        ConfigError: an unknown tokenizer, a bad size, or a `vocabulary` of another kind.
            DataError: a bad text (`read_text`), a part shorter than block_size + 1 tokens, or
            a character outside the given `vocabulary` (named, with its position).
    """
    if tokenizer not in TOKENIZERS:
        raise ConfigError(f"--tokenizer: expected one of {', '.join(TOKENIZERS)}, got "
                          f"{tokenizer!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"--block-size: expected an integer >= 1, got {block_size!r}")
    if vocabulary is not None and vocabulary.kind != tokenizer:
        raise ConfigError(f"--tokenizer {tokenizer}: the run's vocabulary is of kind "
                          f"{vocabulary.kind}; use --tokenizer {vocabulary.kind}")
    text, raw = read_text(path)
    name = f"text:{Path(path).name}"
    given = vocabulary is not None
    if tokenizer == "byte":
        ids, vocabulary = np.frombuffer(raw, dtype=np.uint8), Vocabulary.bytes()
        train_end, val_end = part_sizes(len(ids), val_size=val_size, test_size=test_size,
                                        where=name)
        unknown = np.zeros(len(ids), dtype=bool)
    else:
        points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        train_end, val_end = part_sizes(len(points), val_size=val_size, test_size=test_size,
                                        where=name)
        if vocabulary is None:
            vocabulary = Vocabulary.from_text(text[:train_end])
        ids, unknown = _char_ids(points, vocabulary)
        if given and unknown.any():
            at = int(np.argmax(unknown))
            raise DataError(f"{name}: the character {text[at]!r} at position {at} (line "
                            f"{text.count(chr(10), 0, at) + 1}) is not in the vocabulary of "
                            f"the run ({len(vocabulary.tokens or ())} characters); "
                            f"{int(unknown.sum())} such character(s) in the text")
    has_test = val_end < len(ids)
    counts = {"validation": int(unknown[train_end:val_end].sum())}
    if has_test:
        counts["test"] = int(unknown[val_end:].sum())
    source = TokenArray(ids)
    train = TokenWindows(source, 0, train_end, block_size=block_size, seed=seed,
                         shuffle_offset=True, name=f"{name}: the training part")
    validation = TokenWindows(source, train_end, val_end, block_size=block_size,
                              name=f"{name}: the validation part")
    # Without a test part the test metrics are the validation part's (as nanoGPT reports).
    test = TokenWindows(source, val_end, len(ids), block_size=block_size,
                        name=f"{name}: the test part") if has_test else validation
    return Split(name=name, train=train, validation=validation, test=test,
                 task="classification", num_classes=vocabulary.size, vocabulary=vocabulary,
                 unknown_tokens=counts, fingerprint=_fingerprint(raw, tokenizer))


def _char_ids(points: np.ndarray, vocabulary: Vocabulary) -> tuple[np.ndarray, np.ndarray]:
    """Each code point's id in the (code-point sorted) vocabulary, the unknown id where it has
    none; and where that was."""
    known_points = np.array([ord(c) for c in vocabulary.tokens or ()], dtype="<u4")
    at = np.minimum(np.searchsorted(known_points, points), len(known_points) - 1)
    unknown = known_points[at] != points
    dtype = np.uint16 if vocabulary.size <= 2**16 else np.uint32
    return np.where(unknown, vocabulary.unknown_id, at).astype(dtype), unknown


def _fingerprint(raw: bytes, tokenizer: str) -> str:
    return hashlib.sha256(tokenizer.encode() + b"\0" + raw).hexdigest()
