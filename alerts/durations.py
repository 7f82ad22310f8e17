"""Prometheus durations (``1h30m``, ``90s``, ``500ms``) and the alert severities, shared by the
rule file's loader and its rule kinds."""

from __future__ import annotations

import re

SEVERITIES = ("page", "ticket", "info")
_DURATION = re.compile(
    r"(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?"
)
MIN_GROUP_INTERVAL_SECONDS = 0.1
"""Shortest rule-group interval (each evaluation queries the store)."""
MAX_DURATION_SECONDS = 100 * 365 * 86400
"""Longest accepted duration (Prometheus's limit is about 292 years)."""
_DURATION_UNITS = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def parse_duration(text: object) -> float:
    """A Prometheus duration (``1h30m``, ``90s``, ``500ms``; ``0``) in seconds.

    Raises:
        ValueError: not a duration, or longer than :data:`MAX_DURATION_SECONDS`.
    """
    if text == 0 and not isinstance(text, bool):
        return 0.0
    if not isinstance(text, str):
        raise ValueError(f"expected a duration such as 5m, got {type(text).__name__} {text!r}")
    if text == "0":
        return 0.0
    match = _DURATION.fullmatch(text)
    if not text or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration (use units ms, s, m, h, d, w, y, e.g. 1h30m)")
    seconds = sum(int(g) * unit for g, unit in zip(match.groups(), _DURATION_UNITS, strict=True) if g)
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"{text!r} is longer than 100 years")
    return float(seconds)


def format_duration(seconds: float) -> str:
    """Seconds as the rule file writes them: the largest whole unit (``5m``, ``1h``, ``90s``)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
