"""The Arrow IPC wire format (engine/events_arrow.py) and its vectorised checks
(engine/events_arrow_check.py): a round trip equal to the msgpack path, the same verdict as the
msgspec checks on every rule, and hostile bodies refused with the column and the first bad row."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_testdata import (
    arrow_body,
    arrow_tables,
    batch,
    json_body,
    known_events,
    lookup_event,
    request_event,
)

from agent.arrow_ingest import decode_arrow
from agent.ingest import prepare_batch
from engine.events import EventError, decode_batch
from engine.events_arrow import (
    ARROW_MEDIA_TYPE,
    WIRE_SCHEMAS,
    decode_body,
    header_of,
    media_type,
    sniff_format,
)
from engine.events_arrow_check import batch_dict
from engine.events_arrow_encode import encode_body, encode_tables

BASE = 1_700_000_000.0


def as_strings(table: pa.Table) -> pa.Table:
    """``table`` with dictionary columns decoded (dictionaries may differ, values may not)."""
    return pa.table({name: (pc.cast(col, pa.utf8()) if pa.types.is_dictionary(col.type) else col) for name, col in zip(table.column_names, table.columns, strict=True)})


def tied_request(ts: float) -> dict[str, Any]:
    return request_event(
        ts, "r9", prompt_tokens=500, hash_hit_tokens=400, resume_tokens=300, recoverable_tokens=300, recomputed_tokens=200,
        limiting_form="swa_window", limiting_reason="swa_evicted", limiting_forms=["full_kv", "swa_window"], admission="exact",
    )  # fmt: skip


def rich_events() -> list[dict[str, Any]]:
    return [
        *known_events(BASE),
        tied_request(BASE + 9),
        lookup_event(BASE + 9, "r9", form="indexer_state", outcome="invalidated", reason="indexer_stale", hash_hit_tokens=400,
                     usable_tokens=100, recoverable_tokens=100, indexer_sync_delay_tokens=64, indexer_sync_delay_seconds=1.5),
        lookup_event(BASE + 9, "r9", outcome="invalidated", reason="kv_evicted", hash_hit_tokens=400, usable_tokens=100,
                     recoverable_tokens=100, ghost_tokens=300, ghost_bytes=4096, spare_bytes=512),
    ]


def test_the_arrow_path_stores_exactly_what_the_msgpack_path_does() -> None:
    value = {**batch(5, rich_events()), "run_id": "run-1"}
    from_msgpack = prepare_batch(decode_batch(msgspec.msgpack.encode(value), "msgpack"))
    from_arrow = decode_arrow(arrow_body(value))
    assert from_arrow.events == from_msgpack.events == len(value["events"])
    assert from_arrow.events_by_kind == from_msgpack.events_by_kind
    assert set(from_arrow.tables) == set(from_msgpack.tables) == {"cache_lookups", "requests", "engine_stats", "block_events"}
    for name, table in from_msgpack.tables.items():
        assert from_arrow.tables[name].schema == table.schema, name  # both concatenate in one flush
        assert as_strings(from_arrow.tables[name]).equals(as_strings(table)), name
    assert from_arrow.run_id == "run-1" and from_arrow.seq == 5


def test_the_client_encoder_round_trips_engine_events_in_every_format() -> None:
    events = [msgspec.convert({k: v for k, v in e.items() if k != "kind"}, _struct(e["kind"])) for e in rich_events()]
    by_format = {}
    for fmt in ("arrow", "msgpack", "json"):
        body = encode_body(fmt, events, engine_id="e1", seq=3, sent_at=BASE, run_id="r")
        assert sniff_format(body) == fmt
        decoded = batch_dict(body)
        assert decoded["seq"] == 3 and decoded["run_id"] == "r"
        by_format[fmt] = sorted((e["kind"], e["ts"], e.get("request_id", ""), e.get("form", ""), msgspec.json.encode(e, order="sorted")) for e in decoded["events"])  # type: ignore[union-attr,index]
    # every field of every event survives each format the same (Arrow groups events by kind)
    assert by_format["arrow"] == by_format["msgpack"] == by_format["json"]
    assert len(by_format["arrow"]) == len(events)
    assert media_type(encode_body("arrow", events, engine_id="e1", seq=0, sent_at=BASE)) == ARROW_MEDIA_TYPE
    assert header_of(encode_body("arrow", events, engine_id="e1", seq=7, sent_at=BASE)) == ("e1", 7)


def _struct(kind: str) -> type[msgspec.Struct]:
    from engine.events_arrow import EVENT_CLASSES

    return EVENT_CLASSES[kind]


def test_the_digest_covers_the_events_not_the_header() -> None:
    value = batch(1, known_events(BASE))
    first = decode_body(arrow_body(value)).digest
    assert decode_body(arrow_body({**value, "sent_at": value["sent_at"] + 60, "run_id": "other"})).digest == first
    changed = [*known_events(BASE)[:-1], {**known_events(BASE)[-1], "num_tokens": 32}]
    assert decode_body(arrow_body({**value, "events": changed})).digest != first


def test_an_empty_batch_is_one_stream_of_no_rows() -> None:
    body = encode_tables({}, engine_id="e1", seq=0, sent_at=BASE)
    prepared = decode_arrow(body)
    assert prepared.events == 0 and prepared.tables == {}


def test_a_stream_of_several_record_batches_and_missing_optional_columns_is_taken() -> None:
    tables = arrow_tables(known_events(BASE))
    lookups = tables["cache_lookup"]
    lookups = pa.concat_tables([lookups.slice(0, 2), lookups.slice(2)])  # two record batches
    lookups = lookups.drop_columns(["ghost_tokens", "ghost_bytes", "spare_bytes", "epoch"])  # defaults fill them
    tables["cache_lookup"] = lookups
    prepared = decode_arrow(encode_tables(tables, engine_id="e1", seq=0, sent_at=BASE))
    stored = prepared.tables["cache_lookups"]
    assert stored.num_rows == 4 and stored["epoch"].to_pylist() == [0, 0, 0, 0]
    assert stored["ghost_bytes"].null_count == 4


def test_plain_string_enum_columns_are_taken_and_dictionaries_are_made_canonical() -> None:
    tables = arrow_tables(known_events(BASE))
    lookups = tables["cache_lookup"]
    tables["cache_lookup"] = lookups.set_column(lookups.schema.get_field_index("form"), "form", pc.cast(lookups["form"], pa.utf8()))
    prepared = decode_arrow(encode_tables(tables, engine_id="e1", seq=0, sent_at=BASE))
    assert prepared.tables["cache_lookups"]["form"].type == pa.dictionary(pa.int8(), pa.utf8())
    assert pc.cast(prepared.tables["cache_lookups"]["form"], pa.utf8()).to_pylist() == [e["form"] for e in known_events(BASE) if e["kind"] == "cache_lookup"]


# -- the same verdict as the msgspec checks -----------------------------------------------------------
RULE_CASES = [
    ("hit with a reason", lookup_event(BASE, "r", reason="kv_evicted"), "reason"),
    ("miss without one", lookup_event(BASE, "r", outcome="miss"), "reason"),
    ("usable over hash hit", lookup_event(BASE, "r", hash_hit_tokens=10, usable_tokens=11), "usable_tokens"),
    ("recoverable over usable", lookup_event(BASE, "r", hash_hit_tokens=10, usable_tokens=5, recoverable_tokens=6), "recoverable_tokens"),
    ("ghost over hash hit", lookup_event(BASE, "r", hash_hit_tokens=10, ghost_tokens=11, ghost_bytes=5), "ghost_tokens"),
    ("ghost bytes alone", lookup_event(BASE, "r", hash_hit_tokens=10, ghost_bytes=5), "ghost_bytes"),
    ("ghost bytes 0", lookup_event(BASE, "r", hash_hit_tokens=10, ghost_tokens=4, ghost_bytes=0), "ghost_bytes"),
    ("ghost at usable", lookup_event(BASE, "r", hash_hit_tokens=10, usable_tokens=4, ghost_tokens=4, ghost_bytes=8), "ghost_tokens"),
    ("spare without usable", lookup_event(BASE, "r", spare_bytes=5), "spare_bytes"),
    ("sync delay off the indexer", lookup_event(BASE, "r", hash_hit_tokens=10, indexer_sync_delay_tokens=2), "indexer_sync_delay_tokens"),
    ("sync seconds alone", lookup_event(BASE, "r", form="indexer_state", indexer_sync_delay_seconds=1.0), "indexer_sync_delay_seconds"),
    (
        "sync delay past hash hit",
        lookup_event(BASE, "r", form="indexer_state", hash_hit_tokens=10, indexer_sync_delay_tokens=11),
        "indexer_sync_delay_tokens",
    ),
    ("split not adding up", request_event(BASE, "r", recomputed_tokens=999), "prompt_tokens"),
    ("recoverable over hash hit", request_event(BASE, "r", recoverable_tokens=10, recomputed_tokens=990), "recoverable_tokens"),
    ("resume at the prompt", request_event(BASE, "r", resume_tokens=1000), "resume_tokens"),
    ("ties without the named form", request_event(BASE, "r", limiting_form="full_kv", limiting_forms=["swa_window"]), "limiting_forms"),
    ("a form twice", request_event(BASE, "r", limiting_form="full_kv", limiting_forms=["full_kv", "full_kv"]), "limiting_forms"),
    ("an unknown enum value", lookup_event(BASE, "r", tier="moon"), "tier"),
    ("an unknown tied form", request_event(BASE, "r", limiting_form="full_kv", limiting_forms=["full_kv", "nope"]), "limiting_forms"),
    ("negative tokens", lookup_event(BASE, "r", hash_hit_tokens=-1), "hash_hit_tokens"),
    ("tokens past 2**40", request_event(BASE, "r", output_tokens=2**40 + 1), "output_tokens"),
    ("NaN seconds", request_event(BASE, "r", ttft_seconds=float("nan")), "ttft_seconds"),
    ("infinite ts", lookup_event(float("inf"), "r"), "ts"),
    ("empty request id", lookup_event(BASE, "", hash_hit_tokens=0), "request_id"),
    ("another engine", lookup_event(BASE, "r", engine_id="e2"), "engine_id"),
    ("a negative layer group", lookup_event(BASE, "r", layer_group=-5), "layer_group"),
]


@pytest.mark.parametrize(("label", "bad", "column"), RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_every_rule_refuses_in_both_paths_naming_the_column_and_the_first_bad_row(label: str, bad: dict[str, Any], column: str) -> None:
    good = lookup_event(BASE, "ok") if bad["kind"] == "cache_lookup" else request_event(BASE, "ok")
    value = batch(1, [good, good, bad, bad])
    with pytest.raises(EventError) as json_error:
        decode_batch(json_body(value))
    assert json_error.value.path.startswith(f"$.events[2].{column}"), json_error.value.path
    with pytest.raises(EventError) as arrow_error:
        decode_arrow(arrow_body(value))
    assert (arrow_error.value.column, arrow_error.value.row) == (column, 2), str(arrow_error.value)
    assert arrow_error.value.path == f"$.{bad['kind']}[2].{column}"


def test_valid_rich_events_pass_both_paths() -> None:
    value = batch(1, rich_events())
    decode_batch(json_body(value))
    assert decode_arrow(arrow_body(value)).events == len(value["events"])


# -- hostile bodies -----------------------------------------------------------------------------------
def refusal(body: bytes) -> EventError:
    with pytest.raises(EventError) as error:
        decode_arrow(body)
    return error.value


def stream(table: pa.Table, metadata: dict[bytes, bytes]) -> bytes:
    sink = pa.BufferOutputStream()
    schema = table.schema.with_metadata(metadata)
    with ipc.new_stream(sink, schema) as writer:
        writer.write_table(table.replace_schema_metadata(metadata))
    return sink.getvalue().to_pybytes()


def header(**override: str) -> dict[bytes, bytes]:
    meta = {"kind": "cache_lookup", "schema_version": "1", "engine_id": "e1", "seq": "1", "sent_at": str(BASE), **override}
    return {k.encode(): v.encode() for k, v in meta.items()}


def lookups() -> pa.Table:
    return arrow_tables([lookup_event(BASE, "a"), lookup_event(BASE, "b")])["cache_lookup"]


def test_a_truncated_stream_is_refused() -> None:
    body = arrow_body(batch(1, known_events(BASE)))
    for cut in (5, len(body) // 2, len(body) - 3):
        error = refusal(body[:cut])
        assert error.path.startswith("$.streams[") and "malformed Arrow IPC stream" in error.reason, (cut, str(error))


def test_not_arrow_or_trailing_garbage_is_refused() -> None:
    assert "continuation marker" in refusal(b"{}").reason
    body = arrow_body(batch(1, known_events(BASE)))
    assert refusal(body + b"\x00\x01garbage").path.startswith("$.streams[")


def test_a_wrong_schema_names_the_column() -> None:
    table = lookups()
    retyped = table.set_column(table.schema.get_field_index("usable_tokens"), "usable_tokens", pc.cast(table["usable_tokens"], pa.int32()))
    error = refusal(stream(retyped, header()))
    assert error.column == "usable_tokens" and "expected int64" in error.reason
    error = refusal(stream(table.append_column("surprise", pa.array([1, 2])), header()))
    assert error.column == "surprise" and "unknown column" in error.reason
    error = refusal(stream(table.drop_columns(["outcome"]), header()))
    assert error.column == "outcome" and "missing required column" in error.reason


def test_a_dictionary_with_an_unknown_enum_value_is_refused_where_a_row_uses_it() -> None:
    table = lookups()
    index = table.schema.get_field_index("form")
    dictionary = pa.array(["full_kv", "warp_drive"])
    used = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int8()), dictionary)
    error = refusal(stream(table.set_column(index, "form", used), header()))
    assert (error.column, error.row) == ("form", 1) and "unknown value" in error.reason
    unused = pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int8()), dictionary)
    prepared = decode_arrow(stream(table.set_column(index, "form", unused), header()))
    assert pc.cast(prepared.tables["cache_lookups"]["form"], pa.utf8()).to_pylist() == ["full_kv", "full_kv"]


def test_a_batch_claiming_another_schema_version_is_refused() -> None:
    error = refusal(stream(lookups(), header(schema_version="2")))
    assert error.path == "$.schema_version" and "unsupported schema_version 2" in error.reason


def test_bad_headers_are_refused() -> None:
    assert refusal(stream(lookups(), header(seq="-1"))).path == "$.seq"
    assert refusal(stream(lookups(), header(seq="x"))).path.endswith(".seq")
    assert refusal(stream(lookups(), header(sent_at="nan"))).path == "$.sent_at"
    assert refusal(stream(lookups(), header(engine_id=""))).path == "$.engine_id"
    assert refusal(stream(lookups(), header(run_id="no/slash"))).path == "$.run_id"
    assert "unknown event kind" in refusal(stream(lookups(), header(kind="nope"))).reason
    meta = header()
    del meta[b"engine_id"]
    assert "missing" in refusal(stream(lookups(), meta)).reason
    assert "not UTF-8" in refusal(stream(lookups(), {**header(), b"engine_id": b"\xff\xfe"})).reason


def test_two_streams_must_agree_and_each_kind_comes_once() -> None:
    requests = arrow_tables([request_event(BASE, "a")])["request"]
    one = stream(lookups(), header())
    assert "a second cache_lookup stream" in refusal(one + one).reason
    assert refusal(one + stream(requests, header(kind="request", seq="2"))).path == "$.streams[1].seq"
    decode_arrow(one + stream(requests, header(kind="request")))  # agreeing headers: one batch


def test_nulls_where_no_null_may_be_are_refused() -> None:
    table = lookups()
    index = table.schema.get_field_index("hash_hit_tokens")
    with_null = table.set_column(index, pa.field("hash_hit_tokens", pa.int64(), nullable=True), pa.array([1, None], pa.int64()))
    error = refusal(stream(with_null, header()))
    assert (error.column, error.row) == ("hash_hit_tokens", 1) and "not nullable" in error.reason


def test_a_dictionary_index_out_of_range_is_refused_not_read() -> None:
    table = lookups()
    index = table.schema.get_field_index("tier")
    bad = pa.DictionaryArray.from_arrays(pa.array([0, 5], pa.int8()), pa.array(["device"]), safe=False)
    error = refusal(stream(table.set_column(index, "tier", bad), header()))
    assert error.path == "$.streams[0]" and "out of bounds" in error.reason  # full validation, before any read


def test_an_unknown_dictionary_id_names_that_are_not_utf8_and_unmergeable_dictionaries_are_422s() -> None:
    table = lookups()
    other = stream(table, header())
    schema_end = len(stream(table.slice(0, 0), header())) - 8  # the schema message alone
    spliced = stream(table.select(["ts"]).slice(0, 0), header())[:-8] + other[schema_end:]  # another stream's dictionaries
    assert refusal(spliced).path.startswith("$.streams[")
    raw = stream(table, header())
    assert b"engine_id" in raw
    bad_name = raw.replace(b"request_id", b"request\xff\xfe\xfd", 1)  # same length: only the name is bad
    assert refusal(bad_name).path.startswith("$.")
    index = table.schema.get_field_index("tier")
    junk = [f"x{i}" for i in range(120)]
    first = pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int8()), pa.array(["device", *junk]))
    second = pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int8()), pa.array(["host", *[j + "y" for j in junk]]))
    halves = pa.concat_tables([table.set_column(index, "tier", first), table.set_column(index, "tier", second)])
    error = refusal(stream(halves, header()))
    assert error.path == "$.cache_lookup" and "cannot be combined" in error.reason


def test_wire_schemas_come_from_the_event_structs() -> None:
    from engine.events import CacheLookup

    assert [f.name for f in WIRE_SCHEMAS["cache_lookup"]] == [f.name for f in msgspec.structs.fields(CacheLookup)]
    assert WIRE_SCHEMAS["cache_lookup"].field("ghost_bytes").nullable
    assert not WIRE_SCHEMAS["cache_lookup"].field("usable_tokens").nullable
    assert WIRE_SCHEMAS["request"].field("limiting_forms").type == pa.list_(pa.utf8())
