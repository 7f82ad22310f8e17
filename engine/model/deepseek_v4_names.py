"""Checkpoint tensor names of DeepSeek-V4 → the engine's parameter names.

Three spellings load:

* DeepSeek-native, as released (``embed.weight``, ``layers.<i>.attn.wq_a.weight``,
  ``layers.<i>.ffn.experts.<j>.w1.weight``, ``layers.<i>.hc_attn_fn``, ``hc_head_fn``,
  ``head.weight``, and ``mtp.<k>.*``: a block's names plus ``enorm``, ``hnorm``, ``e_proj``,
  ``h_proj``, ``norm``, ``hc_head_{fn,base,scale}``);
* what transformers' ``save_pretrained`` writes (the native leaves under ``model.``, with
  ``model.embed_tokens`` and ``model.hc_head.*`` kept);
* the engine's own (transformers' module names, experts one module each), written by
  :func:`engine.loader.save_directory`.

The correspondence is the one transformers' ``conversion_mapping.py`` (``deepseek_v4``) applies,
read there and written here as a walk over the name's parts: ``attn`` → ``self_attn``, ``ffn`` →
``mlp``, ``attn_norm`` / ``ffn_norm`` → ``input_layernorm`` / ``post_attention_layernorm``,
``hc_{attn,ffn}_{fn,base,scale}`` → ``{attn,ffn}_hc.*``, ``wq_a`` / ``q_norm`` / ``wq_b`` /
``wkv`` / ``norm`` / ``wo_a`` / ``wo_b`` / ``attn_sink`` → ``q_a_proj`` / ``q_a_norm`` /
``q_b_proj`` / ``kv_proj`` / ``kv_norm`` / ``o_a_proj`` / ``o_b_proj`` / ``sinks``, a
compressor's ``wkv`` / ``wgate`` / ``ape`` / ``norm`` → ``kv_proj`` / ``gate_proj`` /
``position_bias`` / ``kv_norm``, ``indexer.compressor`` → ``compressor.indexer``,
``indexer.wq_b`` / ``weights_proj`` → ``compressor.indexer.q_b_proj`` / ``scorer.weights_proj``,
``gate.bias`` → ``gate.e_score_correction_bias``, and ``w1`` / ``w3`` / ``w2`` → ``gate_proj`` /
``up_proj`` / ``down_proj`` (experts, shared experts and dense MLPs alike).
"""

from __future__ import annotations

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn": "self_attn",
    "ffn": "mlp",
    **{f"hc_{b}_{p}": f"{b}_hc.{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
_ATTENTION = {
    "wq_a": "q_a_proj",
    "q_norm": "q_a_norm",
    "wq_b": "q_b_proj",
    "wkv": "kv_proj",
    "norm": "kv_norm",
    "wo_a": "o_a_proj",
    "wo_b": "o_b_proj",
    "attn_sink": "sinks",
}
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}
_INDEXER = {"wq_b": "q_b_proj", "weights_proj": "scorer.weights_proj"}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_GATE = {"bias": "e_score_correction_bias"}


def _rename(parts: list[str], table: dict[str, str]) -> list[str]:
    return [table.get(parts[0], parts[0]), *parts[1:]] if parts else parts


def _attention(parts: list[str]) -> list[str]:
    if parts[:2] == ["indexer", "compressor"]:
        return ["compressor", "indexer", *_rename(parts[2:], _COMPRESSOR)]
    if parts[:1] == ["indexer"]:
        return ["compressor", "indexer", *_rename(parts[1:], _INDEXER)]
    if parts[:1] == ["compressor"]:
        return ["compressor", *_rename(parts[1:], _COMPRESSOR)]
    return _rename(parts, _ATTENTION)


def _mlp(parts: list[str]) -> list[str]:
    if parts[:1] == ["gate"]:
        return ["gate", *_rename(parts[1:], _GATE)]
    if parts[:1] == ["experts"] and len(parts) > 2:
        return ["experts", parts[1], *_rename(parts[2:], _SWIGLU)]
    if parts[:1] == ["shared_experts"]:
        return ["shared_experts", *_rename(parts[1:], _SWIGLU)]
    return _rename(parts, _SWIGLU)


def block_name(rest: str) -> str:
    """One decoder block's tensor, after ``layers.<i>.`` (or an MTP module's block part)."""
    parts = _rename(rest.split("."), _BLOCK)
    head = parts[0].split(".")  # ``attn_hc.fn`` came out of the table as one part
    parts = [*head, *parts[1:]]
    if parts[0] == "self_attn":
        parts = ["self_attn", *_attention(parts[1:])]
    elif parts[0] == "mlp":
        parts = ["mlp", *_mlp(parts[1:])]
    return ".".join(parts)


_MTP_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


def _mtp(key: str) -> str:
    """``mtp.<k>.*``: the depth's own leaves, its head, else a decoder block's tensor."""
    parts = key.split(".", 2)
    if len(parts) < 3 or not parts[1].isdigit():
        return key
    rest = parts[2]
    if rest in _MTP_HEAD:
        return f"mtp.{parts[1]}.{_MTP_HEAD[rest]}"
    return f"mtp.{parts[1]}.{block_name(rest)}"


def checkpoint_name(key: str) -> str:
    """The engine's parameter name for checkpoint tensor ``key`` (any of the three spellings).

    A name this walk does not know comes back as it is (``model.`` restored), so the loader's
    strict check reports it as unexpected with the checkpoint's own spelling."""
    if key.startswith("mtp."):
        return _mtp(key)
    bare = key.removeprefix("model.")
    if bare in _TOP:
        return _TOP[bare]
    if bare.startswith("layers."):
        _, index, rest = bare.split(".", 2) if bare.count(".") >= 2 else (bare, "", "")
        if index.isdigit() and rest:
            return f"model.layers.{index}.{block_name(rest)}"
    return key if key.startswith(("model.", "lm_head.")) else f"model.{bare}"
