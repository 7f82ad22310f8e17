"""engine.batch_scan against msgspec: the walk reads the header msgspec reads and finds the
nesting depth msgspec's decode sees, in both formats, for any key order and value types."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batch_scan import HEADER_SCAN_BYTES, HEADER_SCAN_TOKENS, batch_header, too_deep

ENCODE = {"json": msgspec.json.encode, "msgpack": msgspec.msgpack.encode}
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.text(min_size=300, max_size=400),  # str16 in msgpack
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=30)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["schema_version", "events", "sent_at", "other"]), values, max_size=4),
    st.text(min_size=1, max_size=20) | st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.integers(min_value=0, max_value=2**63 - 1) | st.text(max_size=3) | st.booleans(),
    st.sampled_from(["json", "msgpack"]),
    st.permutations(range(3)),
)
def test_header_matches_msgspec(rest: dict[str, Any], engine_id: Any, seq: Any, fmt: str, order: list[int]) -> None:
    parts = [("engine_id", engine_id), ("seq", seq), ("rest", None)]
    doc: dict[str, Any] = {}
    for i in order:
        key, value = parts[i]
        if key == "rest":
            doc.update(rest)
        else:
            doc[key] = value
    expected = (engine_id, seq) if isinstance(engine_id, str) and isinstance(seq, int) and not isinstance(seq, bool) else None
    assert batch_header(ENCODE[fmt](doc), fmt) == expected


@settings(max_examples=150, deadline=None)
@given(values, st.integers(min_value=1, max_value=6), st.sampled_from(["json", "msgpack"]))
def test_too_deep_iff_deeper_than_the_limit(value: Any, limit: int, fmt: str) -> None:
    found = too_deep(ENCODE[fmt]({"v": value}), fmt, limit)
    assert (found is not None) == (1 + depth(value) > limit)
    if found is not None:
        assert found.startswith("$.v")


def test_header_after_a_long_events_array_is_read() -> None:
    """Past the walk's first tokens msgspec reads the header; nested 1,000 deep, the walk does."""
    events = [{"kind": "x", "n": i} for i in range(HEADER_SCAN_TOKENS)]
    for fmt, encode in ENCODE.items():
        assert batch_header(encode({"events": events, "engine_id": "e", "seq": 9}), fmt) == ("e", 9)
    deep = b'{"events": [' + b"[" * 1000 + b"]" * 1000 + b', {"a": 1}], "seq": 9, "engine_id": "e"}'
    assert batch_header(deep, "json") == ("e", 9)
    assert too_deep(deep, "json") == "$.events"


def test_past_msgspec_the_walk_reads_a_bounded_number_of_bytes() -> None:
    """A body nested too deep for msgspec with its header last: found within the budget, given
    up (None) past it — a 32 MiB body is not walked to its end."""
    depth = 2000
    deep = b'{"events": [' + b"[" * depth + b"]" * depth + b'], "engine_id": "e", "seq": 9}'
    assert batch_header(deep, "json", scan_bytes=2 * depth + 100) == ("e", 9)
    assert batch_header(deep, "json", scan_bytes=2 * depth - 400) is None  # the budget counts from token 256
    far = b'{"events": [' + b"[" * HEADER_SCAN_BYTES + b"]" * HEADER_SCAN_BYTES + b'], "engine_id": "e", "seq": 9}'
    assert batch_header(far, "json") is None  # the default budget: 64 KiB past the first tokens
    packed = b"\x83" + msgspec.msgpack.encode("events") + b"\x91" * 3000 + b"\x90" + msgspec.msgpack.encode("engine_id") + msgspec.msgpack.encode("e") + msgspec.msgpack.encode("seq") + b"\x09"
    assert batch_header(packed, "msgpack") == ("e", 9)
    assert batch_header(packed, "msgpack", scan_bytes=1000) is None


def test_malformed_bodies_give_none() -> None:
    for body, fmt in [(b'{"engine_id": "e", "seq"', "json"), (b"\xc1", "msgpack"), (b"\x82\xa9engine_id", "msgpack"), (b'"e"', "json"), (b"]", "json")]:
        assert batch_header(body, fmt) is None, body
        assert too_deep(body, fmt) is None, body
