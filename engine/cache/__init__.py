"""The prefix cache: per-form pools, the hash chain, the resume-point coordinator."""

from engine.cache.config import CacheConfig
from engine.cache.coordinator import FormLookup, ResumePlan
from engine.cache.prefix_cache import FormOccupancy, PrefixCache

__all__ = ["CacheConfig", "FormLookup", "FormOccupancy", "PrefixCache", "ResumePlan"]
