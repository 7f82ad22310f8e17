"""Reading an encoded batch without recursion: its header, and where it nests too deep.

msgspec decodes nested values recursively and raises ``RecursionError`` past Python's recursion
limit (about 1,000 levels): a 2 KB body holding a list nested 1,000 deep inside an event field
does that when msgspec must skip the value (an event whose ``kind`` tag comes after it; the
``events`` array when only the header is wanted). This module walks a JSON or msgpack body with
an explicit stack instead — one token at a time, no recursion however deep the body — for the two
things the agent needs from a body msgspec could not decode:

* :func:`batch_header` — the top-level ``engine_id`` and ``seq`` (the rejected-batch audit row
  is filed under them), read as soon as both were seen: a batch that puts them first (as
  :func:`engine.events.encode_batch` does) is read in its first hundred bytes; one that puts
  them after its events is read by msgspec (fast), or by the walk when msgspec's recursion
  would pass Python's limit, for at most :data:`HEADER_SCAN_BYTES` more — so no body makes the
  audit raise ``RecursionError`` or spend seconds of interpreter time;
* :func:`too_deep` — the path of the first value nested deeper than a limit (the 422's path).

Both are best effort over bytes already known to be invalid: a malformed body gives ``None``,
never an exception. The JSON tokens are the grammar of RFC 8259 (strings found with the usual
unrolled ``"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"`` pattern and decoded by msgspec, one scalar at a time);
msgpack's are its specification's type bytes (github.com/msgpack/msgpack/blob/master/spec.md).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import msgspec

NESTING_LIMIT = 64
"""Values nested deeper than this (the batch schema needs 3: batch, events, event) are named by
:func:`too_deep`."""

_MAX_DECODED_STRING = 4096
"""Strings longer than this are skipped, not decoded (no key or header field is that long)."""


class _Malformed(Exception):
    pass


class _Skipped:
    """A scalar the scan did not decode (a long string, binary, an extension)."""


SKIPPED = _Skipped()

Scalar = str | int | float | bool | None | _Skipped


class _Token(NamedTuple):
    """``open`` a container (``is_map``; ``items``: msgpack counts them — a map's keys and values
    both — JSON closes explicitly, None), ``close`` one (JSON), or a ``scalar`` ``value``."""

    kind: Literal["open", "close", "scalar"]
    value: Scalar = None
    is_map: bool = False
    items: int | None = None


_CLOSE = _Token("close")

# -- JSON --------------------------------------------------------------------------------------

_JSON_TOKEN = re.compile(rb'[ \t\n\r]*(?:(")|([\[{])|([\]}])|([:,])|([^ \t\n\r\[\]{}:,"]+))')
_JSON_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def _json_tokens(body: bytes) -> Iterator[tuple[_Token, int]]:
    """Each token with the offset just past it."""
    pos, end = 0, len(body)
    while pos < end:
        match = _JSON_TOKEN.match(body, pos)
        if match is None:
            if not body[pos:].strip():
                return
            raise _Malformed
        pos = match.end()
        if match.group(1):
            rest = _JSON_STRING_REST.match(body, pos)
            if rest is None:
                raise _Malformed
            start, pos = pos - 1, rest.end()
            yield _Token("scalar", _json_scalar(body[start:pos]) if pos - start <= _MAX_DECODED_STRING else SKIPPED), pos
        elif match.group(2):
            yield _Token("open", is_map=match.group(2) == b"{"), pos
        elif match.group(3):
            yield _CLOSE, pos
        elif match.group(5):
            yield _Token("scalar", _json_scalar(match.group(5))), pos
        # ":" and ",": the walk counts items itself


def _json_scalar(text: bytes) -> Scalar:
    try:
        value: object = msgspec.json.decode(text)
    except msgspec.DecodeError:
        raise _Malformed from None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise _Malformed


# -- msgpack -----------------------------------------------------------------------------------

_FIXED: dict[int, tuple[str, int]] = {
    0xCA: (">f", 4), 0xCB: (">d", 8),
    0xCC: (">B", 1), 0xCD: (">H", 2), 0xCE: (">I", 4), 0xCF: (">Q", 8),
    0xD0: (">b", 1), 0xD1: (">h", 2), 0xD2: (">i", 4), 0xD3: (">q", 8),
}
"""Type byte → (struct format, size) of the numbers."""
_LENGTH = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
"""bin8/16/32 and str8/16/32: type byte → width of the length."""
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_CONTAINER = {0xDC: (False, ">H", 2), 0xDD: (False, ">I", 4), 0xDE: (True, ">H", 2), 0xDF: (True, ">I", 4)}
_WIDTH = {1: ">B", 2: ">H", 4: ">I"}


def _msgpack_tokens(body: bytes) -> Iterator[tuple[_Token, int]]:
    """Each token with the offset just past it (past a container's header only)."""
    pos, end = 0, len(body)

    def take(size: int) -> int:
        nonlocal pos
        if pos + size > end:
            raise _Malformed
        start, pos = pos, pos + size
        return start

    def unpack(fmt: str, size: int) -> int | float:
        value: int | float = struct.unpack_from(fmt, body, take(size))[0]
        return value

    def string(size: int, is_str: bool) -> Scalar:
        start = take(size)
        if not is_str or size > _MAX_DECODED_STRING:
            return SKIPPED
        try:
            return body[start : start + size].decode()
        except UnicodeDecodeError:
            raise _Malformed from None

    while pos < end:
        code = body[take(1)]
        if code <= 0x7F or code >= 0xE0:
            token = _Token("scalar", code if code <= 0x7F else code - 0x100)
        elif code <= 0x8F:
            token = _Token("open", is_map=True, items=2 * (code & 0x0F))
        elif code <= 0x9F:
            token = _Token("open", items=code & 0x0F)
        elif code <= 0xBF:
            token = _Token("scalar", string(code & 0x1F, True))
        elif code in (0xC0, 0xC2, 0xC3):
            token = _Token("scalar", None if code == 0xC0 else code == 0xC3)
        elif code in _FIXED:
            token = _Token("scalar", unpack(*_FIXED[code]))
        elif code in _LENGTH:
            size = int(unpack(_WIDTH[_LENGTH[code]], _LENGTH[code]))
            token = _Token("scalar", string(size, code >= 0xD9))
        elif code in _EXT:
            size = int(unpack(_WIDTH[_EXT[code]], _EXT[code]))
            take(1 + size)
            token = _Token("scalar", SKIPPED)
        elif code in _FIXEXT:
            take(1 + _FIXEXT[code])
            token = _Token("scalar", SKIPPED)
        elif code in _CONTAINER:
            is_map, fmt, size = _CONTAINER[code]
            items = int(unpack(fmt, size))
            token = _Token("open", is_map=is_map, items=2 * items if is_map else items)
        else:  # 0xC1: never used
            raise _Malformed
        yield token, pos


# -- the walk ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Frame:
    is_map: bool
    remaining: int | None  # items left (msgpack), None: closed by a token (JSON)
    items: int = 0  # items begun so far (a map's keys and values both)
    key: Scalar = None


def _segment(frame: _Frame) -> str:
    if not frame.is_map:
        return f"[{frame.items - 1}]"
    return f".{frame.key}" if isinstance(frame.key, str) else "[?]"


def _walk(body: bytes, fmt: Literal["json", "msgpack"]) -> Iterator[tuple[list[_Frame], _Token, int]]:
    """Each token with the frames open around it (innermost last), after the token's item was
    counted in its frame, and the offset just past the token. Frames are closed (and popped)
    when complete."""
    stack: list[_Frame] = []
    for token, offset in _json_tokens(body) if fmt == "json" else _msgpack_tokens(body):
        if token.kind == "close":
            if not stack or stack[-1].remaining is not None:
                raise _Malformed
            stack.pop()
            continue
        if stack:
            frame = stack[-1]
            frame.items += 1
            if frame.remaining is not None:
                frame.remaining -= 1
            if frame.is_map and frame.items % 2 == 1:
                frame.key = token.value if token.kind == "scalar" else None
        yield stack, token, offset
        if token.kind == "open":
            stack.append(_Frame(is_map=token.is_map, remaining=token.items))
        while stack and stack[-1].remaining == 0:
            stack.pop()


class _Header(msgspec.Struct):
    engine_id: str
    seq: int


HEADER_SCAN_TOKENS = 256
"""Tokens :func:`batch_header` walks before it lets msgspec look further (C speed)."""
HEADER_SCAN_BYTES = 64 * 1024
"""How far past those tokens :func:`batch_header`'s walk reads on, bytes, when msgspec cannot.
The walk's cost is per token, and a body nested deep is one token per byte (``[[[[``): 64 KiB
took 0.27 s on a loaded 2-core machine, 1 MiB 4.3 s. The header of a body nested too deep for
msgspec that lies further on is not looked for (no audit row; the body still gets its 422)."""


def batch_header(body: bytes, fmt: Literal["json", "msgpack"], *, scan_bytes: int = HEADER_SCAN_BYTES) -> tuple[str, int] | None:
    """The top-level ``engine_id`` (a string) and ``seq`` (an integer) of ``body``, or ``None``
    when either is missing, of another type, or the body is malformed before both were seen.

    The walk reads the first :data:`HEADER_SCAN_TOKENS` tokens (a header written first is read
    there). A header further on — after an ``events`` array — is left to msgspec, a hundred times
    faster than this walk (about 5 MB/s) on a large body; only if msgspec's recursion passes
    Python's limit (a value nested about 1,000 deep) does the walk go on, for ``scan_bytes`` more
    bytes at most (default :data:`HEADER_SCAN_BYTES`), then gives ``None``: a 32 MiB body nested
    deep with its header last costs a fraction of a second, not seconds. Never raises."""
    found: dict[str, Scalar] = {}
    give_up_at: int | None = None
    try:
        for count, (stack, token, offset) in enumerate(_walk(body, fmt)):
            if count == HEADER_SCAN_TOKENS:
                try:
                    return _header_by_msgspec(body, fmt)
                except RecursionError:
                    give_up_at = offset + scan_bytes  # nested too deep for msgspec: read on, so far
            if give_up_at is not None and offset > give_up_at:
                return None
            if len(stack) != 1 or not stack[0].is_map or stack[0].items % 2 == 1:
                continue  # not a top-level value (a key, or something nested)
            key = stack[0].key
            if key in ("engine_id", "seq") and key not in found:
                found[key] = token.value if token.kind == "scalar" else SKIPPED
                if len(found) == 2:
                    break
    except _Malformed:
        return None
    engine_id, seq = found.get("engine_id"), found.get("seq")
    if not isinstance(engine_id, str) or not isinstance(seq, int) or isinstance(seq, bool):
        return None
    return engine_id, seq


def _header_by_msgspec(body: bytes, fmt: Literal["json", "msgpack"]) -> tuple[str, int] | None:
    """Raises RecursionError where a value is nested past Python's recursion limit."""
    try:
        header = msgspec.json.decode(body, type=_Header) if fmt == "json" else msgspec.msgpack.decode(body, type=_Header)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return header.engine_id, header.seq


def too_deep(body: bytes, fmt: Literal["json", "msgpack"], limit: int = NESTING_LIMIT) -> str | None:
    """The path (``$.events[3].request_id``) of the first value whose nesting passes ``limit``
    levels — the path to its innermost field name, the array indices below that left out — or
    ``None`` when nothing nests that deep (or the body is malformed before it). Never recursive;
    never raises."""
    try:
        for stack, token, _ in _walk(body, fmt):
            if token.kind == "open" and len(stack) >= limit:
                named = max((i for i, frame in enumerate(stack) if frame.is_map), default=-1)
                return "$" + "".join(_segment(frame) for frame in stack[: named + 1])
    except _Malformed:
        return None
    return None
