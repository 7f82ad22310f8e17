"""Train a small byte-level checkpoint on the shared text corpus, reproducibly, on CPU.

    python -m engine.train --family kvscope_hybrid --out engine/weights/kvscope_hybrid-small

The corpus is ``shared/data/text`` (Tiny Shakespeare, PEPs, chapters of the Rust book; see its
PROVENANCE.md). The last 128 KiB of Tiny Shakespeare are held out; everything else is training
text. Each step draws ``batch`` windows of ``context`` bytes at seeded random offsets; the model
is trained with AdamW (linear warm-up, cosine decay, gradient clipping) on next-byte cross
entropy. The loss curve goes to ``train_log.jsonl``; at the end the checkpoint is evaluated in
bits per byte on the held-out text at several context lengths, next to a byte-bigram baseline
computed in the same run, and written with a model card.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from engine.loader import FAMILIES, save_directory
from engine.model.base import CausalLM

HELD_OUT_BYTES = 128 * 1024
"""The tail of Tiny Shakespeare kept out of training (long enough for 32K-byte contexts)."""
SCORED_BYTES = 512
"""Bits per byte at context C are measured on the last 512 bytes of windows of C bytes."""


@dataclass(frozen=True, slots=True)
class Corpus:
    train: np.ndarray  # uint8 bytes
    held_out: np.ndarray
    sources: tuple[tuple[str, int], ...]  # (relative path, bytes used for training)


def load_corpus(text_dir: Path) -> Corpus:
    """Training bytes (every document, Shakespeare without its tail) and the held-out tail.

    Raises:
        ValueError: the folder has no Tiny Shakespeare (the held-out text).
    """
    shakespeare = text_dir / "tinyshakespeare" / "input.txt"
    if not shakespeare.is_file():
        raise ValueError(f"{shakespeare}: not found (the corpus is shared/data/text)")
    parts: list[bytes] = []
    sources: list[tuple[str, int]] = []
    data = shakespeare.read_bytes()
    parts.append(data[:-HELD_OUT_BYTES])
    sources.append(("tinyshakespeare/input.txt", len(parts[-1])))
    for f in sorted((text_dir / "peps").glob("*.rst")) + sorted((text_dir / "rust_book").glob("*.md")):
        parts.append(f.read_bytes())
        sources.append((str(f.relative_to(text_dir)), len(parts[-1])))
    train = np.frombuffer(b"\n\n".join(parts), dtype=np.uint8).copy()
    held_out = np.frombuffer(data[-HELD_OUT_BYTES:], dtype=np.uint8).copy()
    return Corpus(train=train, held_out=held_out, sources=tuple(sources))


def sequence_loss(model: CausalLM, window: Tensor) -> Tensor:
    """Mean next-byte cross entropy (nats) of one window ``[T + 1]`` of byte ids."""
    inputs, targets = window[:-1], window[1:]
    logits = model(inputs, torch.arange(len(inputs)), model.new_dense_state())
    return nn.functional.cross_entropy(logits, targets)


@torch.no_grad()
def held_out_bits_per_byte(model: CausalLM, held_out: np.ndarray, context: int, chunk: int = 2048) -> float:
    """Bits per byte on the last :data:`SCORED_BYTES` of consecutive held-out windows of
    ``context`` bytes, each run as one sequence (prefill in chunks of ``chunk``)."""
    total_bits, scored = 0.0, 0
    for start in range(0, len(held_out) - context + 1, context):
        window = torch.from_numpy(held_out[start : start + context].astype(np.int64))
        state = model.new_dense_state()
        pieces = []
        for a in range(0, context - 1, chunk):
            b = min(context - 1, a + chunk)
            pieces.append(model(window[a:b], torch.arange(a, b), state))
        logits = torch.cat(pieces)[-SCORED_BYTES:]
        targets = window[1:][-SCORED_BYTES:]
        total_bits += float(nn.functional.cross_entropy(logits, targets, reduction="sum")) / math.log(2)
        scored += SCORED_BYTES
    return total_bits / scored


def bigram_bits_per_byte(train: np.ndarray, held_out: np.ndarray, context: int) -> float:
    """The same scored bytes as :func:`held_out_bits_per_byte` under an add-one-smoothed
    byte-bigram model estimated on the training bytes."""
    counts = np.ones((256, 256), dtype=np.float64)
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    logp = np.log2(counts / counts.sum(axis=1, keepdims=True))
    bits, scored = 0.0, 0
    for start in range(0, len(held_out) - context + 1, context):
        w = held_out[start : start + context]
        prev, nxt = w[-SCORED_BYTES - 1 : -1], w[-SCORED_BYTES:]
        bits -= float(logp[prev, nxt].sum())
        scored += SCORED_BYTES
    return bits / scored


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(
    model: CausalLM,
    corpus: Corpus,
    *,
    steps: int,
    batch: int,
    context: int,
    lr: float,
    seed: int,
    log_path: Path,
) -> dict[str, Any]:
    """Train in place; returns a summary (final loss, tokens seen, seconds)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    model.train()
    started = time.perf_counter()
    losses: list[float] = []
    with log_path.open("w", encoding="utf-8") as log:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for _ in range(batch):
                start = int(rng.integers(0, len(corpus.train) - context - 1))
                window = torch.from_numpy(corpus.train[start : start + context + 1].astype(np.int64))
                loss = sequence_loss(model, window) / batch
                loss.backward()
                step_loss += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(step_loss)
            record = {"step": step, "loss_nats": round(step_loss, 5), "bits_per_byte": round(step_loss / math.log(2), 5),
                      "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step % 10 == 0 or step == steps - 1:
                print(json.dumps(record), flush=True)
    model.eval()
    tail = losses[-max(1, steps // 20) :]
    return {
        "steps": steps,
        "tokens_seen": steps * batch * context,
        "final_loss_nats": sum(tail) / len(tail),
        "train_seconds": round(time.perf_counter() - started, 1),
    }


def model_card(name: str, family: str, config: Mapping[str, Any], params: int, corpus: Corpus, args: argparse.Namespace,
               summary: Mapping[str, Any], evals: Sequence[Mapping[str, Any]]) -> str:  # fmt: skip
    rows = "\n".join(f"| {e['context']} | {e['model_bpb']:.3f} | {e['bigram_bpb']:.3f} | {e['bigram_bpb'] - e['model_bpb']:+.3f} |" for e in evals)
    sources = "\n".join(f"- `{p}` ({n:,} bytes)" for p, n in corpus.sources)
    return f"""# {name}

A small **{family}** checkpoint trained by kvscope (`python -m engine.train`) so that cache
decisions can be judged on outputs that mean something. Byte-level (token id = byte), no
tokenizer file.

## Model

- layers: {", ".join(config.get("layer_types", []))}
- parameters: {params:,} (float32, {params * 4 / 2**20:.1f} MiB)
- config: `config.json` in this folder

## Data

`shared/data/text` (see its PROVENANCE.md; public-domain / MIT / Apache-2.0 texts). Training
bytes ({len(corpus.train):,} in all):

{sources}

Held out: the last {HELD_OUT_BYTES:,} bytes of Tiny Shakespeare.

## Training

Reproduce: `python -m engine.train --family {family} --config engine/train_configs/{name}.json --out engine/weights/{name} --steps {summary["steps"]} --batch {args.batch} --context {args.context} --lr {args.lr} --seed {args.seed}`

- steps: {summary["steps"]}, batch {args.batch} windows of {args.context} bytes ({summary["tokens_seen"]:,} bytes seen)
- AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices), peak learning rate {args.lr}, linear warm-up then cosine decay to 10 %, gradient clipping 1.0
- seed {args.seed}; {platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}
- wall time: {summary["train_seconds"]:.0f} s
- final training loss (mean of the last 5 % of steps): {summary["final_loss_nats"]:.4f} nats/byte = {summary["final_loss_nats"] / math.log(2):.3f} bits/byte
- loss curve: `train_log.jsonl` (one line per step)

## Held-out bits per byte

Measured on the last {SCORED_BYTES} bytes of consecutive held-out windows of each context length
(so every scored byte sees at least context − {SCORED_BYTES} bytes before it); the byte-bigram
baseline (add-one smoothing, estimated on the training bytes in the same run) is scored on the
same bytes.

| context (bytes) | model | byte bigram | bigram − model |
|---|---|---|---|
{rows}
"""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--config", type=Path, required=True, help="JSON file with the family's config fields")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "text")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.context < 2048:
        parser.error("--context must be at least 2048 bytes")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.text)
    raw = json.loads(args.config.read_text(encoding="utf-8"))
    config_from_dict, build = FAMILIES[args.family].resolve()
    config = config_from_dict({"model_type": args.family, "seed": args.seed, **raw})
    model = build(config)
    model.init_random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = train(model, corpus, steps=args.steps, batch=args.batch, context=args.context, lr=args.lr, seed=args.seed,
                    log_path=args.out / "train_log.jsonl")  # fmt: skip
    evals = []
    for context in args.eval_contexts:
        evals.append({
            "context": context,
            "model_bpb": held_out_bits_per_byte(model, corpus.held_out, context),
            "bigram_bpb": bigram_bits_per_byte(corpus.train, corpus.held_out, context),
        })  # fmt: skip
        print(json.dumps(evals[-1]), flush=True)
    config_dict = {"model_type": args.family, **raw, "seed": args.seed, "revision": f"{args.out.name}-s{args.seed}"}
    save_directory(model, config_dict, args.out)
    params = sum(p.numel() for p in model.parameters())
    card = model_card(args.out.name, args.family, config_dict, params, corpus, args, summary, evals)
    (args.out / "MODEL_CARD.md").write_text(card, encoding="utf-8")
    (args.out / "eval.json").write_text(json.dumps({**summary, "evals": evals}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
