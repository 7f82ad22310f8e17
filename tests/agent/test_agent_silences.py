"""The alert silences API (issue 7): create, list, expire, and refusals that store nothing."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_silences_api(client: TestClient) -> None:
    created = client.post("/v1/silences", json={"matchers": ['engine="e1"', 'alertname=~"Recoverable.*"'], "duration": "2h", "created_by": "op", "comment": "upgrade"})
    assert created.status_code == 200, created.text
    silence = created.json()["silence"]
    assert silence["state"] == "active" and silence["matchers"] == ['engine="e1"', 'alertname=~"Recoverable.*"']
    assert silence["ends_at"] - silence["starts_at"] == 7200
    later = client.post("/v1/silences", json={"matchers": ['engine="e2"'], "starts_at": silence["starts_at"] + 3600, "ends_at": silence["starts_at"] + 7200, "created_by": "op", "comment": "later"})
    assert later.json()["silence"]["state"] == "pending"
    listed = client.get("/v1/silences").json()["silences"]
    assert [s["id"] for s in listed] == [silence["id"], later.json()["silence"]["id"]]
    expired = client.delete(f"/v1/silences/{silence['id']}")
    assert expired.status_code == 200 and expired.json()["silence"]["state"] == "expired"
    assert client.delete("/v1/silences/nope").status_code == 404
    for body, reason in [
        ({"matchers": ["engine"], "duration": "1h", "created_by": "op", "comment": "c"}, "is not a matcher"),
        ({"matchers": ['engine=~".*"'], "duration": "1h", "created_by": "op", "comment": "c"}, "does not match the empty string"),
        ({"matchers": ['engine="e1"'], "created_by": "op", "comment": "c"}, "exactly one of ends_at"),
        ({"matchers": ['engine="e1"'], "duration": "soon", "created_by": "op", "comment": "c"}, "duration: 'soon' is not a duration"),
        ({"matchers": ['engine="e1"'], "duration": "1h", "created_by": " ", "comment": "c"}, "must not be empty"),
        ({"matchers": ['engine="e1"'], "duration": "1h", "created_by": "op", "comment": "c", "x": 1}, "invalid request body"),
        ({"matchers": ['engine="e1"'], "ends_at": 1.0, "created_by": "op", "comment": "c"}, "must end after it starts"),
        ({"matchers": ['engine="e1"'], "ends_at": 1e308, "created_by": "op", "comment": "c"}, "up to 100 years from now"),
        ({"matchers": ['engine="e1"'] * 65, "duration": "1h", "created_by": "op", "comment": "c"}, "at most 64 matchers"),
        ({"matchers": ['engine="e1"'], "duration": "1h", "created_by": "op", "comment": "c" * 3000}, "2048 characters"),
        ({"matchers": ['engine="e1"'], "duration": "1h", "created_by": "op\u0000", "comment": "c"}, "control characters"),
    ]:
        refused = client.post("/v1/silences", json=body)
        assert refused.status_code == 400 and reason in refused.json()["error"]["reason"], (body, refused.text)
    assert len(client.get("/v1/silences").json()["silences"]) == 2  # nothing stored by the refusals


def test_active_alerts_api(client: TestClient) -> None:
    assert client.get("/v1/alerts").status_code == 503  # no rule scheduler in this app
    firing = {"alertname": "Drop", "state": "firing", "labels": {"engine": "e1"}, "annotations": {}, "value": 0.2, "active_at": 1.0, "firing_since": 2.0}
    client.app.state.active_alerts = lambda: [firing]  # type: ignore[attr-defined]
    assert client.get("/v1/alerts").json() == {"alerts": [firing]}
