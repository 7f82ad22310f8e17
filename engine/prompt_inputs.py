"""The prompts ``LLM.generate`` accepts, normalised to lists of token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def normalise_prompts(tokenizer: Encoder, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """One text, one list of token ids, or a list of either → a list of token-id lists.

    Raises:
        ValueError: an item that is neither text nor a sequence of token ids.
    """
    if isinstance(prompts, str):
        return [tokenizer.encode(prompts)]
    items: list[object] = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [[p for p in items if isinstance(p, int)]]
    out: list[list[int]] = []
    for p in items:
        if isinstance(p, str):
            out.append(tokenizer.encode(p))
        elif isinstance(p, Sequence):
            out.append([int(t) for t in p])
        else:
            raise ValueError(f"a prompt must be text or a list of token ids, got {type(p).__name__}")
    return out
