"""Alert rules.

The walking skeleton has one built-in rule, :class:`RecoverableHitRateRule`: it fires for an
(engine, model) series when its **windowed** recoverable hit rate — Σ recoverable tokens /
Σ prompt tokens over the rule's window (DESIGN.md §3), never a lifetime ratio — falls below a
threshold, provided the window saw enough prompt tokens to mean anything.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

TEMPLATE_FIELDS = (
    "alert",
    "engine",
    "model",
    "value",
    "threshold",
    "recoverable_tokens",
    "prompt_tokens",
    "window_seconds",
)
"""Placeholders a summary/description template may use (``str.format`` syntax; ``value`` and
``threshold`` are ratios in [0, 1], so ``{value:.1%}`` prints a percentage)."""

SEVERITIES = ("page", "ticket", "info")


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoverableHitRateRule:
    """Fire when Σ recoverable_tokens / Σ prompt_tokens over ``window_seconds`` < ``threshold``.

    Attributes:
        name: the alert name (``alertname`` in Alertmanager terms).
        threshold: a ratio in (0, 1]; the alert fires strictly below it and resolves at or above.
        window_seconds: the window the token sums are taken over, in seconds.
        min_prompt_tokens: minimum volume; a window with fewer prompt tokens is "no data".
        severity: the ``severity`` label: one of :data:`SEVERITIES`.
        summary, description: templates over :data:`TEMPLATE_FIELDS`.
    """

    name: str = "RecoverableHitRateLow"
    threshold: float = 0.5
    window_seconds: int = 60
    min_prompt_tokens: int = 1000
    severity: str = "page"
    summary: str = (
        "Recoverable hit rate {value:.1%} (fires below {threshold:.0%}) on engine {engine} "
        "model {model}"
    )
    description: str = (
        "Over the last {window_seconds} s, {recoverable_tokens} of {prompt_tokens} prompt tokens "
        "were served from cache without recomputation ({value:.1%}); the alert fires below "
        "{threshold:.0%}. Check which form limits the resume point on the dashboard's Overview."
    )

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"name must be a non-empty identifier, got {self.name!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be a ratio in (0, 1], got {self.threshold}")
        if self.window_seconds < 1:
            raise ValueError(f"window_seconds must be >= 1, got {self.window_seconds}")
        if self.min_prompt_tokens < 1:
            raise ValueError(f"min_prompt_tokens must be >= 1, got {self.min_prompt_tokens}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        for attr in ("summary", "description"):
            template = getattr(self, attr)
            for _, field, _, _ in string.Formatter().parse(template):
                if field is not None and field not in TEMPLATE_FIELDS:
                    raise ValueError(
                        f"{attr} template uses unknown placeholder {{{field}}}; "
                        f"known: {', '.join(TEMPLATE_FIELDS)}"
                    )

    def render(self, template: str, **fields: object) -> str:
        """Fill ``template`` (``self.summary`` or ``self.description``) with ``fields``."""
        return template.format(alert=self.name, threshold=self.threshold, **fields)
