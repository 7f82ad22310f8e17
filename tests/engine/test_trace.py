"""Trace readers (weka, Mooncake), prompt building and the replay loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, CacheConfig
from engine.trace.formats import (
    TraceError,
    TraceRequest,
    load_trace,
    read_mooncake,
    read_weka_session,
)
from engine.trace.prompts import PromptBuilder
from engine.trace.replay import ReplayConfig, replay
from kvscope.data import bundled_trace


def weka_doc(requests: list[dict]) -> dict:
    return {"id": "trace_x", "block_size": 64, "hash_id_scope": "local", "requests": requests}


def req(t: float, ids: list[int], n_in: int, n_out: int = 10) -> dict:
    return {"t": t, "type": "n", "in": n_in, "out": n_out, "hash_ids": ids}


def test_weka_subagents_are_their_own_sessions(tmp_path: Path) -> None:
    doc = weka_doc(
        [
            req(0.0, [1, 2], 130),
            {"type": "subagent", "agent_id": "agent_007", "t": 5.0, "requests": [req(0.0, [1, 9], 128), req(2.5, [1, 9, 10], 200)]},
            req(9.0, [1, 2, 3], 250),
        ]
    )
    path = tmp_path / "trace_x.json"
    path.write_text(json.dumps(doc))
    rows = read_weka_session(path, offset_seconds=100.0)
    assert [(r.arrival_seconds, r.session_id, r.hash_ids) for r in rows] == [
        (100.0, "trace_x", (1, 2)),
        (105.0, "trace_x/agent_007", (1, 9)),
        (107.5, "trace_x/agent_007", (1, 9, 10)),
        (109.0, "trace_x", (1, 2, 3)),
    ]
    assert {r.namespace for r in rows} == {"trace_x"}  # sub-agents share the session's id space
    assert rows[0].remainder_tokens == 2 and rows[1].remainder_tokens == 0


def test_real_weka_and_mooncake_traces_load(shared_data: Path) -> None:
    weka = load_trace(shared_data / "weka_cc_traces" / "traces")
    assert len(weka) > 1000
    assert [r.arrival_seconds for r in weka] == sorted(r.arrival_seconds for r in weka)
    assert any("/" in r.session_id for r in weka)  # sub-agents present
    moon = read_mooncake(shared_data / "mooncake" / "conversation_trace.jsonl")
    assert len(moon) == 12031
    first = moon[0]  # {"timestamp": 0, "input_length": 6758, ..., 14 ids}: 13 full blocks + 102 tokens
    assert (first.input_tokens, len(first.hash_ids), first.remainder_tokens) == (6758, 13, 6758 - 13 * 512)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "malformed JSON"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": []}', "'input_length' must be int"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}', r"hash_ids\[1\] must be an integer"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": []}', "must be >= 0"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": []}', "must be a finite number"),
    ],
)
def test_malformed_trace_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert f"{path}:3" in str(err.value)


def test_missing_or_unknown_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(tmp_path / "x.csv")


def test_shared_blocks_mean_shared_tokens() -> None:
    b = PromptBuilder(block_tokens=4, vocab_size=256)

    def r(rid: str, ns: str, ids: tuple[int, ...], n_in: int) -> TraceRequest:
        return TraceRequest(arrival_seconds=0, session_id=ns, request_id=rid, namespace=ns, hash_ids=ids,
                            input_tokens=n_in, output_tokens=100, block_tokens=64)  # fmt: skip

    p1 = b.prompt(r("a", "s1", (1, 2, 3), 3 * 64 + 10))
    p2 = b.prompt(r("b", "s1", (1, 2, 7, 8), 4 * 64))
    p3 = b.prompt(r("c", "s2", (1, 2, 3), 3 * 64 + 10))
    assert len(p1) == 12 + 1 and len(p2) == 16  # filler: ceil(10 * 4 / 64) = 1 token
    assert p1[:8] == p2[:8] and p1[8:12] != p2[8:12]
    assert p3[:4] != p1[:4]  # ids are namespaced by session
    assert b.output_tokens(r("a", "s1", (1,), 64), cap=16) == 7  # ceil(100 * 4 / 64)
    assert b.output_tokens(r("a", "s1", (1,), 64), cap=3) == 3


def test_replay_of_bundled_slice_is_consistent() -> None:
    requests = load_trace(bundled_trace())
    assert len(requests) == 511
    llm = LLM(cache=CacheConfig(), check_invariants=True)
    seen = []
    tally = replay(
        llm,
        requests,
        ReplayConfig(speed=1e9, max_requests=25, max_output_tokens=2),
        on_request=lambda done, total, r, out: seen.append((done, total, out.cache if out else None)),
    )
    assert [s[0] for s in seen] == list(range(1, 26)) and {s[1] for s in seen} == {25}
    assert tally.requests == 25 and tally.skipped_requests == 0
    assert tally.recoverable_tokens == sum(c.resume_tokens for _, _, c in seen if c is not None)
    assert tally.prompt_tokens == sum(c.prompt_tokens for _, _, c in seen if c is not None)
    for _, _, c in seen:
        assert c is not None and c.resume_tokens <= c.hash_hit_tokens <= c.prompt_tokens
    assert tally.recoverable_tokens > 0  # follow-up turns of the same session reuse their prefix
    assert sum(tally.forms["full_kv"].values()) == 25
