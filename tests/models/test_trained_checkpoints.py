"""The trained checkpoints shipped in engine/weights: they load by preset name, their model cards'
claims hold when measured again here, and they write recognisable English."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.events import Form
from engine.presets import PRESETS
from engine.train import SCORED_BYTES, bigram_bits_per_byte, held_out_bits_per_byte, load_corpus
from tests.helpers import TOLERANCE

CHECKPOINTS = ("kvscope_hybrid-small", "qwen3_next-small", "qwen3_next-hd64")
COMMON_WORDS = {"the", "and", "my", "to", "of", "you", "is", "that", "not", "with", "your", "be", "me", "for",
                "his", "have", "this", "thou", "will", "what", "so", "but", "he", "her", "in", "a", "it", "our"}  # fmt: skip


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_card_claims_the_bigram_margin(name: str) -> None:
    directory = PRESETS[name].directory
    assert directory is not None and (directory / "MODEL_CARD.md").is_file()
    evals = {e["context"]: e for e in json.loads((directory / "eval.json").read_text())["evals"]}
    assert set(evals) == {2048, 8192, 32768}
    if name == "kvscope_hybrid-small":  # the bar for the trained hybrid
        assert evals[2048]["bigram_bpb"] - evals[2048]["model_bpb"] >= 0.5


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_held_out_margin_measured_again(name: str, shared_data: Path) -> None:
    """Eight held-out windows of 2,048 bytes, scored here: the checkpoint beats the bigram by
    at least 0.5 bits per byte on them too."""
    corpus = load_corpus(shared_data / "text")
    held_out = corpus.held_out[: 8 * 2048]
    llm = LLM(name, device="cpu")
    model_bpb = held_out_bits_per_byte(llm.model, held_out, 2048)
    bigram_bpb = bigram_bits_per_byte(corpus.train, held_out, 2048)
    assert bigram_bpb - model_bpb >= 0.5, (model_bpb, bigram_bpb)
    assert len(held_out) >= SCORED_BYTES * 8


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_generates_recognisable_english(name: str) -> None:
    """Sampled as the README shows (temperature 0.7; a fixed seed): printable text made largely
    of common English words. (Greedy decoding of models this small loops on a few words.)"""
    llm = LLM(name, device="cpu")
    text = llm.generate("ROMEO:\n", SamplingParams(max_tokens=200, temperature=0.7, seed=1))[0].text
    printable = sum(ch.isascii() and (ch.isprintable() or ch == "\n") for ch in text) / max(1, len(text))
    words = re.findall(r"[a-z]+", text.lower())
    assert printable > 0.97, text
    assert len(set(words) & COMMON_WORDS) >= 5, text
    assert sum(w in COMMON_WORDS for w in words) >= 0.25 * len(words), text


def test_trained_hybrid_resumes_exactly_through_every_form() -> None:
    """The demo's model: a follow-up turn resumes through every cache form and equals cold."""
    llm = LLM("kvscope_hybrid-small", device="cpu", check_invariants=True)
    first = list(b"ROMEO:\nWhat light through yonder window breaks? " * 12)
    llm.score(first)
    follow_up = [*first, *b"It is the east, and Juliet is the sun."]
    out = llm.score(follow_up)
    assert out.resume_tokens > 0
    assert {f.form for f in out.forms} == set(Form)
    assert all(f.recoverable_tokens == out.resume_tokens for f in out.forms)
    assert (out.logits - llm.prefill_logits(follow_up)[out.resume_tokens :]).abs().max().item() <= TOLERANCE[torch.float32]
