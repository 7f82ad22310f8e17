"""Tokenizers: byte-level by default, or a ``tokenizer.json`` through the ``tokenizers`` library.

Both give ``encode(text) -> ids``, ``decode(ids) -> text`` and ``vocab_size``, and a
:class:`StreamDecoder` that turns tokens into text as they are generated without splitting a
multi-byte character.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value (vocabulary 256). ``decode`` replaces invalid sequences (a
    sampled byte sequence need not be valid UTF-8)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers`` format).

    Raises:
        ValueError: the file cannot be read or parsed (the message names it).
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception subclasses
            raise ValueError(f"{path}: not a readable tokenizer.json ({exc})") from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))


class StreamDecoder:
    """Text of a growing token sequence, emitted piece by piece.

    ``push(token) -> str`` returns the new text that token completes (possibly empty while a
    multi-byte character is still incomplete); ``finish()`` flushes the rest.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") if isinstance(tokenizer, ByteTokenizer) else None
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token: int) -> str:
        if self._bytes is not None:
            return self._bytes.decode(bytes([token])) if 0 <= token < 256 else ""
        self._ids.append(token)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new

    def finish(self) -> str:
        if self._bytes is not None:
            return self._bytes.decode(b"", final=True)
        text = self._tokenizer.decode(self._ids)
        new, self._emitted = text[self._emitted :], len(text)
        return new
