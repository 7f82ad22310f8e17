"""Turning a trace request's hash ids into token ids the engine can run.

Each (namespace, hash id) maps to a deterministic block of N token ids (N = ``block_tokens``), so
two requests share k leading blocks exactly when they share their first k·N tokens. The part of
the trace's prompt beyond its last full block becomes request-unique filler, scaled by the same
factor N / B (B = the trace's block size) and rounded up, so any remainder keeps at least one
unique token.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from engine.trace.formats import TraceRequest


class PromptBuilder:
    """Builds prompts of ``block_tokens`` tokens per trace block from ids in ``[0, vocab_size)``.

    Raises:
        ValueError: ``block_tokens`` or ``vocab_size`` not positive.
    """

    def __init__(self, block_tokens: int, vocab_size: int, seed: int = 0) -> None:
        if block_tokens <= 0 or vocab_size <= 0:
            raise ValueError(f"block_tokens ({block_tokens}) and vocab_size ({vocab_size}) must be positive")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[tuple[str, int], list[int]] = {}

    def _tokens(self, key: str, n: int) -> list[int]:
        digest = hashlib.blake2b(f"{self.seed}|{key}".encode(), digest_size=8).digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
        return rng.integers(0, self.vocab_size, size=n).tolist()

    def block(self, namespace: str, hash_id: int) -> list[int]:
        """The N tokens of one trace block (memoised)."""
        key = (namespace, hash_id)
        tokens = self._blocks.get(key)
        if tokens is None:
            tokens = self._tokens(f"block|{namespace}|{hash_id}", self.block_tokens)
            self._blocks[key] = tokens
        return tokens

    def filler_tokens(self, request: TraceRequest) -> int:
        return math.ceil(request.remainder_tokens * self.block_tokens / request.block_tokens)

    def prompt(self, request: TraceRequest) -> list[int]:
        """Token ids of the request's prompt: its blocks, then its unique filler (≥ 1 token)."""
        out: list[int] = []
        for h in request.hash_ids:
            out.extend(self.block(request.namespace, h))
        filler = self.filler_tokens(request)
        if not out and filler == 0:
            filler = 1
        out.extend(self._tokens(f"filler|{request.request_id}", filler))
        return out

    def output_tokens(self, request: TraceRequest, cap: int) -> int:
        """Tokens to decode: the trace's output scaled by N / B, at least 1, at most ``cap``."""
        scaled = math.ceil(request.output_tokens * self.block_tokens / request.block_tokens)
        return max(1, min(cap, scaled)) if cap > 0 else 0
