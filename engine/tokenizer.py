"""Byte-level tokenizer: token id = UTF-8 byte value (vocabulary 256)."""

from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
    """``encode(text)`` gives the UTF-8 bytes; ``decode(ids)`` joins them back, replacing
    invalid sequences (a sampled byte sequence need not be valid UTF-8)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")
