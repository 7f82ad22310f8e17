"""The Forms page (issue 8, item 2) against a real agent: a form's outcomes, its Pareto of
reasons, recovery-latency quantiles and heatmap from the rollup's cumulative buckets, the tier
split and how often it set L*; a form without lookups."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from agent.rollups import fold_cache_minute
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file, render_template
from tests.dashboard.agent_fixture import RunningAgent, render_page, running_agent

M0 = (int(time.time()) // 60 - 3) * 60  # a whole minute, three minutes ago


def lookup(ts: float, n: int, outcome: str, reason: str, tier: str = "device", recovery: float = 0.0) -> dict[str, object]:
    return {
        "kind": "cache_lookup", "ts": ts, "engine_id": "e1", "request_id": f"q{n}", "model": "m1", "form": "swa_window",
        "tier": tier, "outcome": outcome, "reason": reason, "hash_hit_tokens": 64, "usable_tokens": 64,
        "recoverable_tokens": 0 if outcome == "invalidated" else 64, "recovery_seconds": recovery,
    }  # fmt: skip


def request(n: int, limiting: str | None) -> dict[str, object]:
    return {
        "kind": "request", "ts": M0 + 30 + n, "engine_id": "e1", "request_id": f"r{n}", "model": "m1",
        "prompt_tokens": 100, "output_tokens": 1, "hash_hit_tokens": 64, "resume_tokens": 32, "recoverable_tokens": 32,
        "replayed_tokens": 0, "recomputed_tokens": 68, "admission": "exact", "ttft_seconds": 0.1, "e2e_seconds": 0.2,
        "limiting_form": limiting, "limiting_reason": "swa_evicted" if limiting else "none",
    }  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RunningAgent]:
    """swa_window: minute M0 has 6 hits, 3 swa_evicted, 1 epoch_changed and 4 recoveries from host
    (2 at 20 ms, 2 at 200 ms); minute M0+60 has 2 more swa_evicted. Of 3 requests, 2 were limited
    by swa_window."""
    events = (
        [lookup(M0 + 1, i, "hit", "none") for i in range(6)]
        + [lookup(M0 + 2, 10 + i, "invalidated", "swa_evicted") for i in range(3)]
        + [lookup(M0 + 3, 20, "invalidated", "epoch_changed")]
        + [lookup(M0 + 4, 30 + i, "recovered", "kv_evicted", "host", 0.02 if i < 2 else 0.2) for i in range(4)]
        + [lookup(M0 + 61, 40 + i, "invalidated", "swa_evicted") for i in range(2)]
        + [request(0, "swa_window"), request(1, "swa_window"), request(2, None)]
    )
    with running_agent(tmp_path) as running:
        body = {"schema_version": 1, "engine_id": "e1", "seq": 0, "sent_at": M0, "events": events}
        response = httpx.post(f"{running.url}/v1/events", json=body, timeout=10)
        assert response.json()["status"] == "stored", response.text
        assert fold_cache_minute(running.store) == 16
        yield running


def page(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, **query: str) -> AppTest:
    return render_page("forms_page", agent.url, monkeypatch, **query)


def dataset(at: AppTest, index: int, column: str) -> dict[str, list[object]]:
    chart = at.get("vega_lite_chart")[index]
    for d in chart.proto.datasets:
        table = pa.ipc.open_stream(d.data.data).read_all().to_pydict()
        if column in table:
            return table
    raise AssertionError(f"no dataset with {column} in chart {index}: {json.loads(chart.proto.spec).get('mark')}")


def test_one_forms_story(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch, form="swa_window")
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert [s.value for s in at.subheader] == [
        "Why it lost tokens", "Outcomes over time", "Recovery latency", "Tier split", "How often swa_window set L*",
    ]  # fmt: skip
    lost = at.dataframe[0].value  # ranked by tokens lost as the limiting form: 2 requests, 32 each
    assert lost[["reason", "label", "tokens_lost", "requests"]].values.tolist() == [["swa_evicted", "sliding window evicted (swa_evicted)", 64, 2]]
    assert "**swa_window — sliding window evicted (swa_evicted)**: 64 tokens lost over 2 requests." in [m.value for m in at.markdown]
    reasons = at.dataframe[1].value
    assert reasons[["reason", "lookups"]].values.tolist() == [["sliding window evicted (swa_evicted)", 5], ["state replaced (epoch changed) (epoch_changed)", 1]]
    assert reasons["cumulative_share"].round(4).tolist() == [0.8333, 1.0]
    outcomes = dataset(at, 1, "outcome")
    assert json.loads(at.get("vega_lite_chart")[1].proto.spec)["encoding"]["color"]["scale"]["range"][:2] == ["#2ca02c", "#1f77b4"]  # hit green, recovered blue
    assert set(outcomes["outcome"]) == {"hit", "recovered", "invalidated"}
    quantiles = dataset(at, 2, "seconds")
    by_quantile = dict(zip(quantiles["quantile"], quantiles["seconds"], strict=True))
    # 4 recoveries: 2 in (0.01, 0.025], 2 in (0.1, 0.25]; linear within a bucket, as histogram_quantile
    assert by_quantile == pytest.approx({"p50": 0.025, "p95": 0.235, "p99": 0.247})
    heat = dataset(at, 3, "band")
    cells = {band: n for band, n in zip(heat["band"], heat["recoveries"], strict=True) if n}
    assert cells == {"≤ 0.025 s": 2, "≤ 0.25 s": 2}
    tiers = at.dataframe[2].value
    assert tiers[["tier", "lookups", "share_of_lookups"]].values.tolist() == [["device", 12, 0.75], ["host", 4, 0.25]]
    assert at.metric[0].value == "66.7%"
    for_reason, link = at.get("page_link")  # to the requests swa_window limited (for its reason)
    assert link.proto.page == "requests" and "form=swa_window" in link.proto.query_string.split("&")
    assert for_reason.proto.page == "requests" and {"form=swa_window", "reason=swa_evicted"} <= set(for_reason.proto.query_string.split("&"))


def test_a_form_without_lookups(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    at.selectbox(key="forms_form").set_value("linear_state").run()
    assert not at.exception
    assert at.info[0].value.startswith("No linear_state lookups in this window yet")


def test_rank_disagreements_name_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups another tensor-parallel rank held back show which rank, how often, and the tokens
    lost, on the form's page only."""
    held = {"outcome": "invalidated", "reason": "tp_disagree", "hash_hit_tokens": 96, "usable_tokens": 32, "recoverable_tokens": 32}
    events = [
        lookup(M0 + 1, 1, "hit", "none"),
        {**lookup(M0 + 2, 2, "invalidated", "tp_disagree"), **held, "tp_rank": 1},
        {**lookup(M0 + 3, 3, "invalidated", "tp_disagree"), **held, "tp_rank": 1},
        {**lookup(M0 + 4, 4, "invalidated", "tp_disagree"), **held, "tp_rank": 1, "form": "linear_state"},
    ]
    with running_agent(tmp_path) as running:
        body = {"schema_version": 1, "engine_id": "e1", "seq": 0, "sent_at": M0, "events": events}
        assert httpx.post(f"{running.url}/v1/events", json=body, timeout=10).json()["status"] == "stored"
        assert fold_cache_minute(running.store) > 0
        at = page(running, monkeypatch, form="swa_window")
        assert not at.exception and not at.error, [e.value for e in at.error]
        assert at.subheader[-1].value == "Tensor-parallel rank disagreements"
        table = at.dataframe[-1].value
        assert table[["tp_rank", "lookups", "tokens_lost", "requests"]].values.tolist() == [[1, 2, 128, 2]]


def test_the_shipped_runbook_link_opens_the_form_and_reason_that_fired(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = load_rule_file(DEFAULT_RULES_PATH).with_dashboard_url(agent.url)
    (spike,) = [r for r in rules.rules if r.alert == "FormInvalidationSpike"]
    url = urlsplit(render_template(spike.annotations["runbook_url"], {"engine": "e1", "form": "swa_window", "reason": "epoch_changed"}, 0.3))
    assert url.path == "/forms"
    at = page(agent, monkeypatch, **{k: v[0] for k, v in parse_qs(url.query).items()})
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.selectbox(key="form").value == "swa_window" and at.selectbox(key="engine").value == "e1"
    assert "Form swa_window (set in the sidebar)." in [c.value for c in at.caption]
    # the reason that fired is named on the page even though it limited no request
    assert "swa_window lost no tokens for state replaced (epoch changed) (epoch_changed) in this window." in [c.value for c in at.caption]
