"""Strict checks for the alerting YAML files (rule files, notification files, golden series):
each raises the caller's error class with the place (file, group, field) first, so every file
kind reports problems the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def mapping(
    value: object, where: str, allowed: Iterable[str], required: Iterable[str] = (), *, error: type[ValueError]
) -> dict[str, Any]:
    """``value`` as a mapping with only ``allowed`` keys and every ``required`` one.

    Raises:
        ``error``: not a mapping, an unknown key, or a missing one.
    """
    if not isinstance(value, dict):
        raise error(f"{where}: expected a mapping, got {type(value).__name__}")
    allowed = set(allowed)
    unknown = set(value) - allowed
    if unknown:
        raise error(f"{where}: unknown field {sorted(map(str, unknown))[0]!r}; known: {', '.join(sorted(allowed))}")
    missing = set(required) - set(value)
    if missing:
        raise error(f"{where}: missing field {sorted(missing)[0]!r}")
    return value


def items(value: object, where: str, *, error: type[ValueError]) -> list[Any]:
    """``value`` as a list.

    Raises:
        ``error``: not a list.
    """
    if not isinstance(value, list):
        raise error(f"{where}: expected a list, got {type(value).__name__}")
    return value


def parsed(where: str, parse: Callable[[], Any], *, error: type[ValueError]) -> Any:
    """``parse()``, its ``ValueError`` re-raised as ``error`` prefixed with ``where``."""
    try:
        return parse()
    except ValueError as exc:
        raise error(f"{where}: {exc}") from None
