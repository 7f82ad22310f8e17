"""The ``tokens_lost`` named query: lost tokens charged to the limiting form and reason, ties under
every tied form with each form's own reason."""

from __future__ import annotations

import time

from agent_testdata import batch, json_body, lookup_event, request_event
from fastapi.testclient import TestClient

from agent.queries import NAMED_QUERIES

JSON = {"content-type": "application/json"}


def rows(client: TestClient, **params: object) -> list[dict[str, object]]:
    response = client.get("/v1/query/tokens_lost", params=params)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["columns"] == list(NAMED_QUERIES["tokens_lost"].columns)
    return [dict(zip(body["columns"], row, strict=True)) for row in body["rows"]]


def _store(client: TestClient) -> float:
    now = time.time()
    lost = {"prompt_tokens": 1000, "hash_hit_tokens": 800, "recomputed_tokens": 1000, "admission": "lower_resume"}
    events = [
        # a: swa_window alone, 800 lost
        request_event(now - 20, "a", **lost, limiting_form="swa_window", limiting_reason="swa_evicted", limiting_forms=["swa_window"]),
        # b: a tie of swa_window (named, swa_evicted) and linear_state (its lookup says why), 600 lost
        request_event(
            now - 10, "b", prompt_tokens=1000, hash_hit_tokens=800, recoverable_tokens=200, recomputed_tokens=800,
            admission="lower_resume", limiting_form="swa_window", limiting_reason="swa_evicted",
            limiting_forms=["swa_window", "linear_state"],
        ),
        lookup_event(now - 10, "b", form="linear_state", outcome="invalidated", reason="linear_checkpoint_missing", hash_hit_tokens=800, usable_tokens=200, recoverable_tokens=200),
        lookup_event(now - 10, "b", form="linear_state", outcome="hit", reason="none", hash_hit_tokens=800, usable_tokens=800, recoverable_tokens=800),
        # c: a full hit loses nothing and is left out
        request_event(now - 5, "c", prompt_tokens=1000, hash_hit_tokens=800, recoverable_tokens=800, recomputed_tokens=200, admission="exact"),
        # d: no form limited, the admission recomputed: a NULL form
        request_event(now - 5, "d", **lost, limiting_reason="admission_recompute_cheaper"),
        # e: an hour ago, outside a 10-minute window
        request_event(now - 3600, "e", **lost, limiting_form="full_kv", limiting_reason="kv_evicted", limiting_forms=["full_kv"]),
    ]  # fmt: skip
    assert client.post("/v1/events", content=json_body(batch(1, events)), headers=JSON).json()["status"] == "stored"
    return now


def test_ties_count_under_every_tied_form_with_its_own_reason(client: TestClient) -> None:
    _store(client)
    assert rows(client, since_seconds=600) == [
        {"form": "swa_window", "reason": "swa_evicted", "tokens_lost": 1400, "requests": 2, "tied_requests": 1, "tied_tokens_lost": 600},
        {"form": None, "reason": "admission_recompute_cheaper", "tokens_lost": 800, "requests": 1, "tied_requests": 0, "tied_tokens_lost": 0},
        {"form": "linear_state", "reason": "linear_checkpoint_missing", "tokens_lost": 600, "requests": 1, "tied_requests": 1, "tied_tokens_lost": 600},
    ]  # fmt: skip


def test_without_a_window_every_stored_request_counts_and_filters_apply(client: TestClient) -> None:
    _store(client)
    every = rows(client)
    assert {(r["form"], r["tokens_lost"]) for r in every} == {("swa_window", 1400), (None, 800), ("linear_state", 600), ("full_kv", 800)}
    assert rows(client, form="linear_state", since_seconds=600) == [
        {"form": "linear_state", "reason": "linear_checkpoint_missing", "tokens_lost": 600, "requests": 1, "tied_requests": 1, "tied_tokens_lost": 600}
    ]
    assert rows(client, reason="kv_evicted")[0]["form"] == "full_kv"
    assert rows(client, engine_id="other") == []


def test_a_bad_window_is_a_400_naming_the_parameter(client: TestClient) -> None:
    response = client.get("/v1/query/tokens_lost", params={"since_seconds": 0})
    assert response.status_code == 400
    assert "since_seconds" in response.text


def test_recent_requests_lists_the_requests_behind_each_charge(client: TestClient) -> None:
    """The Forms page's link from a (form, reason) of ``tokens_lost`` to the Requests page:
    ``recent_requests`` filtered on that limiting form and reason lists exactly the requests that
    lost tokens charged there — a tied form's requests under its own reason too."""
    _store(client)

    def requests(**params: object) -> list[str]:
        response = client.get("/v1/query/recent_requests", params={"since_seconds": 600, **params})
        assert response.status_code == 200, response.text
        body = response.json()
        return sorted(row[body["columns"].index("request_id")] for row in body["rows"])

    assert requests(limiting_form="linear_state") == ["b"]  # tied, not the named form
    assert requests(limiting_form="linear_state", limiting_reason="linear_checkpoint_missing") == ["b"]
    assert requests(limiting_form="linear_state", limiting_reason="swa_evicted") == []  # the named form's reason is not its own
    assert requests(limiting_form="swa_window", limiting_reason="swa_evicted") == ["a", "b"]
    assert requests(limiting_reason="admission_recompute_cheaper") == ["d"]
    for charge in rows(client, since_seconds=600):
        if charge["form"] is not None:
            assert len(requests(limiting_form=charge["form"], limiting_reason=charge["reason"])) == charge["requests"], charge
