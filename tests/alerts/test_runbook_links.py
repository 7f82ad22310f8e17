"""Runbook links into the dashboard (issue 23): ``{{ $dashboardURL }}`` (the agent's
``dashboard_url``, as Prometheus's ``$externalURL``) and ``| urlquery`` on labels, and the shipped
rules' ``runbook_url`` opening the Forms page on the alert's engine, form and reason."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from agent.config import AgentConfig
from alerts.prometheus_export import export_prometheus
from alerts.rulefile import DEFAULT_RULES_PATH, check_template, load_rule_file, render_template
from alerts.templates import bind_dashboard_url

LABELS = {"engine": "host-a 1&b", "model": "m1", "form": "swa_window", "reason": "swa_evicted", "tp_rank": "1", "layer_group": "0", "tier": "host"}
DASHBOARD_PARAMS = {"window", "engine", "model", "form", "reason"}
"""The query parameters the dashboard reads (dashboard/common.py and the Forms page)."""


def test_dashboard_url_and_urlquery_render() -> None:
    text = "{{ $dashboardURL }}/forms?engine={{ $labels.engine | urlquery }}&form={{ $labels.form }}"
    check_template(text)
    bound = bind_dashboard_url(text, "http://dash.example:8501/")
    assert render_template(bound, LABELS, None) == "http://dash.example:8501/forms?engine=host-a+1%26b&form=swa_window"
    assert render_template(text, LABELS, None) == "/forms?engine=host-a+1%26b&form=swa_window"  # unbound: relative


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{{ $value | urlquery }}", "urlquery applies to labels only"),
        ("{{ $labels.form | humanize }}", "applies to $value only, not to labels (those take urlquery)"),
        ("{{ $labels.form | urlencode }}", "unknown template pipe 'urlencode'"),
        ("{{ $externalURL }}", "unsupported template"),
    ],
)
def test_bad_link_templates_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("$", r"\$").replace("(", r"\(").replace(")", r"\)")):
        check_template(text)


def test_every_shipped_runbook_url_opens_forms_on_the_alerts_labels() -> None:
    rules = load_rule_file(DEFAULT_RULES_PATH).with_dashboard_url("http://127.0.0.1:8501")
    expected = {  # the alert's labels that choose what the Forms page shows
        "RecoverableHitRateDrop": {"engine": LABELS["engine"], "model": "m1"},
        "RecoverableHitRateSLO": {"engine": LABELS["engine"]},
        "FormInvalidationSpike": {"engine": LABELS["engine"], "form": "swa_window", "reason": "swa_evicted"},
        "TensorParallelRankDisagreement": {"engine": LABELS["engine"], "form": "swa_window", "reason": "tp_disagree"},
        "IndexerSyncDelay": {"engine": LABELS["engine"], "model": "m1", "form": "indexer_state"},
        "RecoveryLatencyHigh": {"engine": LABELS["engine"], "form": "swa_window"},
    }
    linked = {rule.alert: rule.annotations["runbook_url"] for rule in rules.rules if "runbook_url" in rule.annotations}
    assert set(linked) == set(expected)
    for alert, template in linked.items():
        url = urlsplit(render_template(template, LABELS, 0.5))
        assert (url.scheme, url.netloc, url.path) == ("http", "127.0.0.1:8501", "/forms"), alert
        query = {k: v[0] for k, v in parse_qs(url.query, strict_parsing=True).items()}
        assert query == expected[alert], alert
        assert set(query) <= DASHBOARD_PARAMS


def test_the_prometheus_export_binds_the_dashboard_url() -> None:
    rules = load_rule_file(DEFAULT_RULES_PATH)
    for url, prefix in (("http://dash:8501", "http://dash:8501/forms?"), ("", "/forms?")):
        exported = yaml.safe_load(export_prometheus(rules, dashboard_url=url))
        links = [r["annotations"]["runbook_url"] for g in exported["groups"] for r in g["rules"] if "runbook_url" in r.get("annotations", {})]
        assert links and all(link.startswith(prefix) and "dashboardURL" not in link for link in links)
        assert all("| urlquery }}" in link for link in links)  # Prometheus's own template function


@pytest.mark.parametrize("url", ["dash:8501", "ftp://dash", "http://dash/{{ $value }}"])
def test_a_bad_dashboard_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="dashboard_url must be an http"):
        AgentConfig(dashboard_url=url)
