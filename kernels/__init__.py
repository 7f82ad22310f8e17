"""Triton kernels for the CUDA path, one file per kernel with its plain-torch reference.

The engine runs its torch path on every device today; the kernels (paged attention, the
compressor, the indexer, the gated delta rule, block copies) are added by the kernels work.
"""
