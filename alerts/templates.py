"""Alert templates: the Prometheus subset ``{{ $labels.NAME }}``, ``{{ $value }}`` and the pipes
``humanize``, ``humanizePercentage``, ``humanizeDuration`` on the value and ``urlquery`` on a
label, plus ``{{ $dashboardURL }}`` — the dashboard's URL, as Prometheus's ``$externalURL`` is its
own, so a ``runbook_url`` can open the dashboard's Forms page on the alert's form and reason
(checked when a rule file loads, rendered when an alert notifies)."""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Callable, Mapping

_TEMPLATE_PART = re.compile(r"\{\{(.*?)\}\}", re.S)
_EXPRESSION = re.compile(r"\s*\$(value|dashboardURL|labels\.([a-zA-Z_][a-zA-Z0-9_]*))\s*(?:\|\s*([a-zA-Z]+)\s*)?")
_DASHBOARD_URL = re.compile(r"\{\{\s*\$dashboardURL\s*\}\}")
def format_value(value: float) -> str:
    """``$value`` as Prometheus prints a float (Go's shortest ``%g``): the fewest digits that
    read back exactly, in exponent form when the exponent is below −4 or at least 6
    (123456789 → ``1.23456789e+08``, 0.5 → ``0.5``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    for digits in range(1, 18):
        scientific = f"{value:.{digits - 1}e}"
        if float(scientific) == value:
            break
    mantissa, _, exponent_text = scientific.partition("e")
    exponent = int(exponent_text)
    if exponent < -4 or exponent >= 6:
        if "." in mantissa:
            mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    return f"{value:.{max(digits - 1 - exponent, 0)}f}"


def humanize(value: float) -> str:
    """Prometheus's ``humanize``: SI prefixes, four significant digits (12345 → 12.35k)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.4g}"
    prefix = ""
    if abs(value) >= 1:
        for symbol in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(value) < 1000:
                break
            prefix, value = symbol, value / 1000
    else:
        for symbol in ("m", "u", "n", "p", "f", "a", "z", "y"):
            if abs(value) >= 1:
                break
            prefix, value = symbol, value * 1000
    return f"{value:.4g}{prefix}"


def humanize_duration(value: float) -> str:
    """Prometheus's ``humanizeDuration``: 5400 → ``1h 30m 0s``, 0.875 → ``875ms``."""
    if not math.isfinite(value):
        return f"{value:.4g}"
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value == 0:
        return "0s"
    if value >= 1:
        seconds = int(value)
        days, hours = seconds // 86400, seconds // 3600 % 24
        minutes, rest = seconds // 60 % 60, seconds % 60
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {rest}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {rest}s"
        if minutes:
            return f"{sign}{minutes}m {rest}s"
        return f"{sign}{value:.4g}s"
    prefix = ""
    for symbol in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if value >= 1:
            break
        prefix, value = symbol, value * 1000
    return f"{sign}{value:.4g}{prefix}s"


PIPES: dict[str, Callable[[float], str]] = {
    "humanize": humanize,
    "humanizePercentage": lambda v: f"{v * 100:.4g}%",
    "humanizeDuration": humanize_duration,
}
"""Template pipes, as Prometheus's template functions of the same names format values."""


def check_template(text: str) -> None:
    """Raise ValueError naming the first ``{{ ... }}`` this template language does not know."""
    for match in _TEMPLATE_PART.finditer(text):
        expression = _EXPRESSION.fullmatch(match.group(1))
        if expression is None:
            raise ValueError(
                f"unsupported template {match.group(0)!r}: use {{{{ $value }}}}, "
                f"{{{{ $labels.NAME }}}} and the pipes {', '.join(PIPES)}"
            )
        pipe, label = expression.group(3), expression.group(2)
        if pipe is not None and pipe not in (*PIPES, "urlquery"):
            raise ValueError(f"unknown template pipe {pipe!r} in {match.group(0)!r}; known: {', '.join(PIPES)}, urlquery")
        if pipe is not None and label is not None and pipe != "urlquery":
            raise ValueError(f"pipe {pipe!r} applies to $value only, not to labels (those take urlquery), in {match.group(0)!r}")
        if pipe == "urlquery" and label is None:
            raise ValueError(f"pipe urlquery applies to labels only, in {match.group(0)!r}")
    if "{{" in _TEMPLATE_PART.sub("", text) or "}}" in _TEMPLATE_PART.sub("", text):
        raise ValueError(f"unbalanced braces in template {text!r}")


def bind_dashboard_url(text: str, dashboard_url: str) -> str:
    """``text`` with every ``{{ $dashboardURL }}`` replaced by ``dashboard_url`` (without a
    trailing ``/``), the rest left for :func:`render_template`."""
    return _DASHBOARD_URL.sub(lambda _: dashboard_url.rstrip("/"), text)


def render_template(text: str, labels: Mapping[str, str], value: float | None) -> str:
    """Fill a checked template: ``$labels.NAME`` (empty when absent; ``| urlquery`` escapes it
    for a URL's query), ``$value`` (``no data`` when None) and ``$dashboardURL`` when no URL was
    bound (:func:`bind_dashboard_url`): empty, so a link stays relative to the dashboard."""

    def fill(match: re.Match[str]) -> str:
        expression = _EXPRESSION.fullmatch(match.group(1))
        assert expression is not None, "templates are checked at load"
        if expression.group(1) == "dashboardURL":
            return ""
        if expression.group(2) is not None:
            text = labels.get(expression.group(2), "")
            return urllib.parse.quote_plus(text) if expression.group(3) == "urlquery" else text
        if value is None:
            return "no data"
        pipe = expression.group(3)
        return PIPES[pipe](value) if pipe else format_value(value)

    return _TEMPLATE_PART.sub(fill, text)
