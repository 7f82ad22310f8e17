"""Placeholder until the MTP layout is confirmed."""

from __future__ import annotations

from torch import nn

from engine.model.deepseek_v4_config import DeepseekV4Config


class DeepseekV4MTP(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()


def mtp_checkpoint_name(key: str) -> str:
    return key
