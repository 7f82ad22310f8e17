"""The Capacity page (issue 8, item 6) against a real agent: the pools' latest values and their
series from two engines' stats, GPU memory and utilisation from gpu_stats rows; no GPU said so;
the what-if over recorded lookups with ghost resume points."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from agent.store import to_timestamp
from tests.dashboard.agent_fixture import RunningAgent, render_page, running_agent

NOW = time.time()
MiB = 1024 * 1024


def stats(engine: str, ts: float, form: str, used: int, cached: int, total: int) -> dict[str, object]:
    return {
        "kind": "engine_stats", "ts": ts, "engine_id": engine, "model": "m1", "form": form, "tier": "device",
        "used_bytes": used * MiB, "used_blocks": used, "cached_blocks": cached, "free_blocks": total - used, "total_blocks": total,
    }  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RunningAgent]:
    """Two engines' full_kv pools (64 and 32 blocks of 1 MiB) and e1's swa_window (16 blocks), in
    one 15-second bucket: e1's full_kv used 40 then 48 blocks (mean 44), e2's 16."""
    global NOW
    NOW = time.time()  # per test: a module-level clock would age past the page's window in a long run
    bucket = (int(NOW) // 15 - 2) * 15
    with running_agent(tmp_path) as running:
        for seq, (engine, events) in enumerate(
            [
                ("e1", [stats("e1", bucket + 1, "full_kv", 40, 30, 64), stats("e1", bucket + 9, "full_kv", 48, 30, 64),
                        stats("e1", bucket + 1, "swa_window", 8, 4, 16)]),
                ("e2", [stats("e2", bucket + 2, "full_kv", 16, 10, 32)]),
            ]
        ):  # fmt: skip
            body = {"schema_version": 1, "engine_id": engine, "seq": seq, "sent_at": NOW, "events": events}
            assert httpx.post(f"{running.url}/v1/events", json=body, timeout=10).json()["status"] == "stored"
        yield running


def page(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, **query: str) -> AppTest:
    return render_page("capacity_page", agent.url, monkeypatch, **query)


def test_pools_and_no_gpu(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    assert not at.exception and not at.error, [e.value for e in at.error]
    pools = at.dataframe[0].value
    assert pools[["form", "used_blocks", "cached_blocks", "total_blocks"]].values.tolist() == [
        ["full_kv", 64, 40, 96],  # each engine's latest snapshot: e1's 48 + e2's 16; totals 64 + 32
        ["swa_window", 8, 4, 16],
    ]
    assert pools["used_MiB"].tolist() == [64.0, 8.0] and pools["fill"].round(4).tolist() == [0.6667, 0.5]
    series = next(pa.ipc.open_stream(d.data.data).read_all().to_pydict() for d in at.get("vega_lite_chart")[0].proto.datasets)
    assert dict(zip(series["pool"], series["used_MiB"], strict=True)) == {"full_kv/device": 60.0, "swa_window/device": 8.0}  # e1's mean 44 + 16
    assert len(at.get("vega_lite_chart")) == 2
    assert at.info[0].value.startswith("No GPU samples: the agent found no NVIDIA GPU")
    narrowed = page(agent, monkeypatch, form="swa_window", engine="e1")
    assert narrowed.dataframe[0].value["form"].tolist() == ["swa_window"]


def test_gpus(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    with agent.store.transaction() as cur:
        for offset, used, util in ((20, 40, 0.5), (10, 60, 0.7)):
            cur.execute(
                "INSERT INTO gpu_stats VALUES ($ts, 0, 'NVIDIA H200', $used, $total, $util)",
                {"ts": to_timestamp(NOW - offset), "used": used * 1024**3, "total": 141 * 1024**3, "util": util},
            )
    at = page(agent, monkeypatch, window="5 minutes")
    assert not at.exception and not at.error
    assert [s.value for s in at.subheader] == ["Pools per form and tier", "GPUs", "What if a form had more memory"]
    charts = at.get("vega_lite_chart")
    assert len(charts) == 4  # two pool charts, GPU memory and utilisation
    (memory,) = [pa.ipc.open_stream(d.data.data).read_all().to_pydict() for d in charts[2].proto.datasets]
    assert memory["memory_used_GiB"] == [40.0, 60.0] and memory["gpu"] == ["0 NVIDIA H200"] * 2
    (utilisation,) = [pa.ipc.open_stream(d.data.data).read_all().to_pydict() for d in charts[3].proto.datasets]
    assert utilisation["utilization_ratio"] == [0.5, 0.7]
    assert [i.value for i in at.info] == ["No cache lookups in this window yet: nothing to replay."]


def request(rid: str, resume: int) -> dict[str, object]:
    return {
        "kind": "request", "ts": NOW - 5, "engine_id": "e1", "request_id": rid, "model": "m1", "prompt_tokens": 1000,
        "output_tokens": 1, "hash_hit_tokens": 1000, "resume_tokens": resume, "recoverable_tokens": resume, "replayed_tokens": 0,
        "recomputed_tokens": 1000 - resume, "admission": "exact", "ttft_seconds": 0.1, "e2e_seconds": 0.2,
    }  # fmt: skip


def lookup(rid: str, form: str, usable: int, ghost_tokens: int = 0, ghost_mib: float | None = None, spare_mib: float | None = None) -> dict[str, object]:
    lost = ghost_mib is not None
    return {
        "kind": "cache_lookup", "ts": NOW - 6, "engine_id": "e1", "request_id": rid, "model": "m1", "form": form, "tier": "device",
        "outcome": "invalidated" if lost else "hit", "reason": "swa_evicted" if lost else "none", "hash_hit_tokens": 1000,
        "usable_tokens": usable, "recoverable_tokens": usable, "ghost_tokens": ghost_tokens,
        "ghost_bytes": int(ghost_mib * MiB) if lost else None, "spare_bytes": None if spare_mib is None else int(spare_mib * MiB),
    }  # fmt: skip


def test_what_if_more_memory(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """r1 resumed at 200 (its window evicted; 4 MiB more would have let it resume at 800), r2 at 0
    (12 MiB more: 600). Recorded 200 of 2000 prompt tokens; +4 MiB: 800; +16 MiB: 1400. What r1
    read had 1 MiB to spare in the window pool and 2 MiB in full_kv."""
    events = [
        lookup("r1", "full_kv", 800, spare_mib=2.0), lookup("r1", "swa_window", 200, 800, 4.0, spare_mib=1.0), request("r1", 200),
        lookup("r2", "full_kv", 600, spare_mib=8.0), lookup("r2", "swa_window", 0, 600, 12.0), request("r2", 0),
    ]  # fmt: skip
    body = {"schema_version": 1, "engine_id": "e1", "seq": 5, "sent_at": NOW, "events": events}
    assert httpx.post(f"{agent.url}/v1/events", json=body, timeout=10).json()["status"] == "stored"
    at = page(agent, monkeypatch)
    assert not at.exception and not at.error, [e.value for e in at.error]

    def figures() -> dict[str, tuple[str, str | None]]:
        return {m.label: (m.value, m.delta or None) for m in at.metric}

    assert figures() == {
        "Recorded recoverable hit rate": ("10.0%", None),
        "With this memory": ("10.0%", "+0.0 pp"),
        "Model with no extra memory": ("10.0%", None),
    }
    ghosts = at.dataframe[1].value.set_index("form")
    assert ghosts.loc["swa_window", ["lost_lookups", "saved_by_memory", "ghost_mib_max", "ghost_gain_tokens"]].tolist() == [2, 2, 12.0, 1200]
    assert ghosts.loc["swa_window", "ghost_mib_p50"] == 8.0 and ghosts.loc["full_kv", "lost_lookups"] == 0
    at.number_input(key="whatif_swa_window").set_value(4.0).run()
    assert figures()["With this memory"] == ("40.0%", "+30.0 pp")
    at.number_input(key="whatif_swa_window").set_value(16.0).run()
    assert figures()["With this memory"] == ("70.0%", "+60.0 pp")
    at.number_input(key="whatif_full_kv").set_value(64.0).run()  # full_kv lost nothing: no change
    assert figures()["With this memory"] == ("70.0%", "+60.0 pp")
    # less memory: a lookup whose spare the cut exceeds resumes nowhere
    at.number_input(key="whatif_full_kv").set_value(0.0).run()
    at.number_input(key="whatif_swa_window").set_value(-0.5).run()  # r1's window had 1 MiB to spare
    assert figures()["With this memory"] == ("10.0%", "+0.0 pp")
    at.number_input(key="whatif_swa_window").set_value(-2.0).run()  # not 2 MiB: r1 recomputes too
    assert figures()["With this memory"] == ("0.0%", "-10.0 pp")
    at.number_input(key="whatif_swa_window").set_value(0.0).run()
    at.number_input(key="whatif_full_kv").set_value(-4.0).run()  # r1's full_kv had 2 MiB to spare, r2's 8
    assert figures()["With this memory"] == ("0.0%", "-10.0 pp")
