"""Checkpoint loading: time and peak memory of ``engine.loader.load_model`` against the
checkpoint's size and against a plain safetensors read of the same files, side by side in one
run (issue 21).

A random Qwen3-Next checkpoint (dense MLPs, float32; ``--hidden-size`` / ``--layers`` set its
size) is written once as shards with their index (``save_directory(max_shard_bytes=...)``).
Then, alternating, each in a fresh subprocess so that its peak RSS is its own:

* ``engine``: ``load_model(directory, cpu)`` — headers checked, tensors copied into the built
  model one at a time;
* ``plain``: every tensor of every file read with ``safe_open(...).get_tensor`` and kept (what
  holding the checkpoint costs: the floor for any loader that keeps the weights).

Each subprocess reports its RSS after its imports (``baseline_rss_bytes``) and its peak
(``ru_maxrss``); ``peak_over_baseline / checkpoint_bytes`` is the figure to read: about 1 for a
loader holding the model plus one tensor, about 2 for one that holds the checkpoint and the model.

Prints one JSON object; progress on stderr. No target is asserted (absolute times on a shared
machine are context). Run: ``python -m benchmarks.load [--hidden-size 768] [--layers 8]
[--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from pathlib import Path

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

import torch
from safetensors import safe_open
from engine.loader import load_model
import engine.model.qwen3_next  # warm: the family's imports and a first meta-device build cost
with torch.device("meta"):     # ~150 MB of library pages once per process, not the load's memory
    engine.model.qwen3_next.build(engine.model.qwen3_next.config_from_dict({"num_hidden_layers": 1, "num_experts": 0}))

mode, path = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)
baseline = rss()
t0 = time.perf_counter()
if mode == "engine":
    loaded = load_model(path, torch.device("cpu"))
    held = sum(p.numel() for p in loaded.model.parameters())
else:
    tensors = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            tensors += [handle.get_tensor(k).clone() for k in handle.keys()]
    held = sum(t.numel() for t in tensors)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "elements": held}))
"""


def checkpoint(directory: Path, hidden: int, layers: int, dtype: str = "float32") -> int:
    """Write the random checkpoint (weights in ``dtype``); returns its bytes on disk."""
    from engine.loader import save_directory
    from engine.model.qwen3_next import Qwen3NextForCausalLM, config_from_dict

    raw = {
        "model_type": "qwen3_next", "vocab_size": 32000, "hidden_size": hidden, "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": hidden // 8,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": hidden // 8,
        "linear_value_head_dim": hidden // 8, "num_experts": 0, "revision": "bench-load",
    }  # fmt: skip
    model = Qwen3NextForCausalLM(config_from_dict(raw))
    total = sum(t.nbytes for t in model.state_dict().values())
    save_directory(model, raw, directory, max_shard_bytes=total // 4 + 1)
    if dtype != "float32":  # the shards in that dtype, as a released checkpoint declares it
        import torch
        from safetensors.torch import load_file, save_file

        for f in directory.glob("*.safetensors"):
            save_file({k: v.to(getattr(torch, dtype)) for k, v in load_file(str(f)).items()}, str(f))
        (directory / "config.json").write_text(json.dumps({**raw, "dtype": dtype}))
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def run(mode: str, directory: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(directory)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="the checkpoint's dtype")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        size = checkpoint(directory, args.hidden_size, args.layers, args.dtype)
        print(f"load: checkpoint {size / 2**20:.0f} MiB in {len(list(directory.glob('*.safetensors')))} shards", file=sys.stderr)
        runs: dict[str, list[dict[str, float]]] = {"engine": [], "plain": []}
        for i in range(args.repeats):
            for mode in ("engine", "plain") if i % 2 == 0 else ("plain", "engine"):
                runs[mode].append(run(mode, directory))
                print(f"load: {mode} {runs[mode][-1]['seconds']:.2f} s", file=sys.stderr)
    result: dict[str, object] = {"benchmark": "load", "checkpoint_bytes": size, "dtype": args.dtype, "repeats": args.repeats,
                                 "load_average": os.getloadavg()}  # fmt: skip
    for mode, rs in runs.items():
        over = statistics.median(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in rs)
        result[mode] = {
            "seconds_median": statistics.median(r["seconds"] for r in rs),
            "peak_over_baseline_bytes": over,
            "peak_over_baseline_per_checkpoint_byte": over / size,
            "elements": rs[0]["elements"],
        }
    engine, plain = result["engine"], result["plain"]
    assert isinstance(engine, dict) and isinstance(plain, dict)
    result["engine_over_plain_seconds"] = engine["seconds_median"] / plain["seconds_median"]
    result["engine_over_plain_peak"] = engine["peak_over_baseline_bytes"] / plain["peak_over_baseline_bytes"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
