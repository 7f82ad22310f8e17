"""The vLLM side of ``benchmarks/peer_vllm.py``, run by ``.venv-vllm/bin/python`` (``make
peer-vllm``): loads one checkpoint into vLLM's offline ``LLM`` once, then answers one JSON
command per stdin line with one JSON line on stdout (everything else vLLM prints goes to stderr).

Commands: ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}`` →
``{"seconds", "outputs": [[ids...]], "cached_tokens": [n, ...]}`` (one batch, greedy);
``{"op": "reset"}`` empties vLLM's prefix cache; ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=9216)
    parser.add_argument("--kv-cache-gib", default="2")
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = args.kv_cache_gib
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # the protocol gets its own copy of stdout; fd 1 becomes stderr, so that nothing vLLM or the
    # engine processes it spawns print reaches the protocol
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(args.threads)
    caching = not args.no_prefix_caching
    extra = {"mamba_cache_mode": "align"} if caching else {}
    error = None
    try:
        llm = LLM(
            model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
            enable_prefix_caching=caching, enforce_eager=True, max_num_seqs=8, **extra,
        )  # fmt: skip
    except Exception as exc:  # reported to the benchmark, which records it
        error = f"{type(exc).__name__}: {exc}"
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens if error is None else None
    hello = {"ready": error is None, "error": error, "vllm": __import__("vllm").__version__, "prefix_caching": caching and error is None}
    print(json.dumps({**hello, "max_num_batched_tokens": budget}), file=out, flush=True)
    if error is not None:
        return
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        if command["op"] == "reset":
            llm.reset_prefix_cache()
            answer: dict[str, object] = {"ok": True}
        else:
            params = SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in command["prompts"]]
            t0 = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            answer = {
                "seconds": seconds,
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached_tokens": [int(r.num_cached_tokens or 0) for r in results],
            }
        print(json.dumps(answer), file=out, flush=True)


if __name__ == "__main__":
    main()
