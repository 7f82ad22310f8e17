"""The ``qwen3_5`` family (Qwen3.5 dense and MoE, text decoder and the released vision-language
layout): Qwen3-Next's decoder (:mod:`engine.model.qwen3_next`) built from a Qwen3.5 config
(:mod:`engine.model.qwen3_5_config`), its checkpoint tensors renamed by
:func:`~engine.model.qwen3_5_config.checkpoint_name`."""

from __future__ import annotations

from engine.model.qwen3_5_config import checkpoint_name, config_from_dict
from engine.model.qwen3_next import Qwen3NextForCausalLM, build

__all__ = ["Qwen3NextForCausalLM", "build", "checkpoint_name", "config_from_dict"]
