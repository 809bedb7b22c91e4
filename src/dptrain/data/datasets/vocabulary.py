"""The vocabulary of a language-model run: how text becomes token ids and back.

    vocab = Vocabulary.from_text("hello world")     # characters, sorted, plus one unknown id
    ids = vocab.encode("hello", where="prompt")     # tensor([3, 2, 4, 4, 5])
    vocab.decode(ids)                               # "hello"
    Vocabulary.from_json(vocab.to_json()) == vocab  # stored in the run as vocabulary.json

Three kinds: `char` (the distinct characters of the training text, in code-point order, then
one reserved id for a character the training text never had), `byte` (the 256 byte values of
the UTF-8 encoding; nothing is unknown) and `ids` (pre-tokenized data: only a size, and tokens
from nanoGPT's `meta.pkl` where it has them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dptrain.errors import DataError

Kind = Literal["char", "byte", "ids"]
FILE_NAME = "vocabulary.json"
"""Where a run directory keeps its vocabulary (written by the Trainer, read by generate,
init-from and load_run)."""


@dataclass(frozen=True)
class Vocabulary:
    kind: Kind
    size: int
    """Number of ids the model's output layer must cover (char: the characters + 1 unknown)."""
    tokens: tuple[str, ...] | None = None
    """char: the character of each id below `unknown_id`; ids: the strings of nanoGPT's
    meta.pkl `itos` where present; byte: None."""

    @classmethod
    def from_text(cls, text: str) -> Vocabulary:
        chars = tuple(sorted(set(text)))
        return cls(kind="char", size=len(chars) + 1, tokens=chars)

    @classmethod
    def bytes(cls) -> Vocabulary:
        return cls(kind="byte", size=256)

    @property
    def unknown_id(self) -> int | None:
        """The id a character outside the vocabulary maps to (char only)."""
        return self.size - 1 if self.kind == "char" else None

    @property
    def unit(self) -> str:
        """What one token is, for bits per unit: character, byte or token."""
        return {"char": "character", "byte": "byte", "ids": "token"}[self.kind]

    def encode(self, text: str, *, where: str, strict: bool = True) -> torch.Tensor:
        """Ids (int64) of `text`. With `strict`, a character outside a char vocabulary raises
        one line naming it and its position in `where`; otherwise it maps to `unknown_id`."""
        if self.kind == "byte":
            return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)
        if self.kind != "char":
            raise DataError(f"{where}: this run's vocabulary is pre-tokenized ids; text cannot "
                            f"be encoded without its tokenizer")
        index = self._index()
        ids = []
        for position, ch in enumerate(text):
            found = index.get(ch)
            if found is None:
                if strict:
                    raise DataError(f"{where}: the character {ch!r} at position {position} is not "
                                    f"in the run's vocabulary of {len(index)} characters")
                found = self.unknown_id
            ids.append(found)
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.kind == "byte":
            return bytes(values).decode("utf-8", errors="replace")
        if self.tokens is None:
            return " ".join(str(i) for i in values)
        return "".join(self.tokens[i] if i < len(self.tokens) else "\ufffd" for i in values)

    def _index(self) -> dict[str, int]:
        return {ch: i for i, ch in enumerate(self.tokens or ())}

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self.size,
                "tokens": list(self.tokens) if self.tokens is not None else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Vocabulary:
        tokens = data.get("tokens")
        return cls(kind=data["kind"], size=int(data["size"]),
                   tokens=tuple(tokens) if tokens is not None else None)

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, ensure_ascii=False)

    @classmethod
    def load(cls, path) -> Vocabulary:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))
