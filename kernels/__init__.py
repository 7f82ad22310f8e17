"""Triton kernels for the CUDA path, one file per kernel with its plain-torch reference
(``<name>_ref``); on CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``) in tests.

* :mod:`kernels.kv_block_copy` — block gather/scatter between pools and staging buffers
  (swap-out, swap-in) for every form's layout.
* :mod:`kernels.paged_decode_attention` — decode attention through a block table: GQA, sliding
  window, attention sink, padding rows on the sentinel page skipped.
* :mod:`kernels.paged_prefill_attention` — chunked prefill over the cached prefix and the chunk,
  causal, varlen (``cu_seqlens``), GQA, sliding window.

* :mod:`kernels.compressor` — DeepSeek-V4's gated pooling of groups of r rows into compressed
  entries (overlapping CSA and plain HCA), and its decode step over static pending rows.

* :mod:`kernels.indexer_topk` — the lightning indexer's scores (ReLU per head, weighted, summed,
  causal at compressed granularity) and its top-k, ties to the earlier entry.

* :mod:`kernels.sparse_compressed_attention` — DeepSeek-V4's window-plus-compressed attention
  (CSA's selected entries or HCA's ended groups), shared K = V, learned sinks.

* :mod:`kernels.gated_delta_rule` — Gated DeltaNet's chunked prefill and fused recurrent forms
  on a varlen batch (state in and out, in place optionally) and the causal conv's decode step.
  Their plain-torch forms, which the engine's torch path runs, are in
  :mod:`kernels.gated_delta_rule_torch` (no Triton import).

:mod:`kernels.launch` says when the launchers skip their host reads of device values (while a
CUDA graph is captured, and in the runs the serving runtime's model runner makes as a capture
would), and puts each launch on its tensors' GPU.

The engine calls them through :mod:`engine.model.kernel_backend` (``LLM(kernel_backend=...)``;
the default picks them on CUDA).
"""
