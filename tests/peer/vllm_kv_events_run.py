"""Run vLLM's CPU build on a tiny Qwen3-Next checkpoint with its ZMQ KV-event publisher on, and
write every message it published to a JSON file (run with ``.venv-vllm/bin/python``; see
``make peer-vllm``). ``tests/peer/test_vllm_kv_events_live.py`` runs it against a live agent, and the
committed fixture ``tests/peer/data/vllm_kv_events.json`` is one such recording.

Usage: ``python tests/peer/vllm_kv_events_run.py OUT.json --pub tcp://127.0.0.1:PORT``
(``--replay tcp://127.0.0.1:PORT2`` adds vLLM's replay socket).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--pub", required=True, help="where vLLM binds its PUB socket (tcp://127.0.0.1:PORT)")
    parser.add_argument("--replay", default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    sys.path.insert(0, str(ROOT))
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.peer_vllm import tiny_checkpoint

    frames: list[list[bytes]] = []
    stop = threading.Event()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(args.pub)

    def collect() -> None:
        while not stop.is_set():
            if sub.poll(100):
                frames.append(sub.recv_multipart())

    with tempfile.TemporaryDirectory() as tmp:
        tiny_checkpoint(Path(tmp))
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": args.pub.replace("127.0.0.1", "*")}
        if args.replay:
            events["replay_endpoint"] = args.replay.replace("127.0.0.1", "*")
        llm = LLM(
            model=tmp, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=True,
            mamba_cache_mode="align", kv_events_config=events, max_num_seqs=2, enforce_eager=True, num_gpu_blocks_override=32,
        )  # fmt: skip
        thread = threading.Thread(target=collect, daemon=True)
        thread.start()
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the PUB socket first
        params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
        shared = [(7 * i) % 251 + 1 for i in range(520)]
        # two follow-ups on one prefix (blocks stored, then hit), then distinct prompts that fill the
        # small pool (32 blocks of 256 tokens over 4 groups) so that cached blocks are evicted
        prompts = [shared + [(3 * i + j) % 251 + 1 for i in range(40)] for j in range(2)]
        prompts += [[(11 * i + 13 * j) % 251 + 1 for i in range(560)] for j in range(1, 7)]
        for prompt in prompts:  # one at a time: each sees the blocks the ones before stored
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            print("cached tokens:", out[0].num_cached_tokens, "output:", out[0].outputs[0].token_ids)
        llm.reset_prefix_cache()  # AllBlocksCleared, published with the next step's events
        llm.generate([TokensPrompt(prompt_token_ids=shared[:300])], params, use_tqdm=False)
        time.sleep(1.0)
        stop.set()
        thread.join()
        del llm
    record = [{"topic": f[0].decode(), "seq": int.from_bytes(f[1], "big"), "payload": base64.b64encode(f[2]).decode()} for f in frames]
    args.out.write_text(json.dumps({"vllm": __import__("vllm").__version__, "messages": record}, indent=1) + "\n")
    print(f"{len(record)} messages written to {args.out}")


if __name__ == "__main__":
    main()
