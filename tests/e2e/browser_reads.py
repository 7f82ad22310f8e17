"""What the dashboard's browser test reads from a rendered page, and the agent's answers it
compares them with: the Overview's headline (an ``st.metric``), the time axes Vega drew (SVG),
the filters in a page's URL, and the form and reason that lost most tokens (``tokens_lost``)."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

DONE = '.stApp[data-test-script-state="notRunning"]'
"""Streamlit's marker that the page's script run finished (so every panel has been drawn)."""
PERCENT = re.compile(r"\d{1,3}\.\d%")
"""An ``st.metric`` value of :func:`dashboard.overview._percent` (``77.2%``)."""
CLOCK = re.compile(r"(?:[01]\d|2[0-3]):[0-5]\d")
"""A 24-hour tick label (``19:50``); the date at midnight reads ``12-03``."""
DATE = re.compile(r"\d\d-\d\d")
CHARTS_DRAWN = """() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
  return charts.length > 0 && charts.every(c => c.querySelector('svg g.role-axis[aria-roledescription="axis"]'));
}"""
"""True once every chart on the page has drawn its axes (Vega renders them to SVG here)."""
AXES = """() => [...document.querySelectorAll('[data-testid="stVegaLiteChart"] g.role-axis[aria-roledescription="axis"]')]
  .map(axis => ({description: axis.getAttribute('aria-label') || '',
                 labels: [...axis.querySelectorAll('.role-axis-label text')].map(t => t.textContent)}))"""
"""Every axis Vega drew: its ARIA description (which names the scale: ``for a utc scale``) and
its tick labels."""
METRICS = """() => Object.fromEntries([...document.querySelectorAll('[data-testid="stMetric"]')].map(m => [
  m.querySelector('[data-testid="stMetricLabel"]').innerText.trim(), m.querySelector('[data-testid="stMetricValue"]').innerText.trim()]))"""
"""Every ``st.metric`` on the page, label → value, read at once (the live panel may redraw)."""


def headline(page: Any, timeout_ms: int = 90_000) -> tuple[str, int]:
    """The Overview's headline once it shows a figure (not "not enough traffic") and the page's
    script run finished: the recoverable hit rate as shown (``77.2%``) and the prompt tokens of
    the window it is over, read together."""
    from playwright.sync_api import expect

    metric = page.locator('[data-testid="stMetric"]').filter(has=page.get_by_text("Recoverable hit rate", exact=True))
    expect(metric.locator('[data-testid="stMetricValue"]')).to_have_text(PERCENT, timeout=timeout_ms)
    page.wait_for_selector(DONE, timeout=timeout_ms)
    metrics = page.evaluate(METRICS)
    prompt = next(value for label, value in metrics.items() if label.startswith("Prompt tokens (last "))
    return metrics["Recoverable hit rate"], int(prompt.replace(",", ""))


def rate_text(tokens: int, prompt_tokens: int) -> str:
    """A ratio as the headline shows it (:func:`dashboard.overview._percent`)."""
    return f"{tokens / prompt_tokens:.1%}"


def headline_candidates(agent_url: str, min_prompt_tokens: int) -> set[tuple[str, int]]:
    """Every headline the Overview could have shown while requests were being stored, as
    :func:`headline` reads it: the recoverable hit rate and prompt tokens of the requests stored
    by each flush (a flush stores its batches at one ``ingested_at``, in one transaction), from
    ``min_prompt_tokens`` prompt tokens on. Exact while every request is inside the headline's
    trailing window."""
    rows = sql(
        agent_url,
        "SELECT sum(sum(prompt_tokens)) OVER w::BIGINT, sum(sum(recoverable_tokens)) OVER w::BIGINT "
        "FROM requests GROUP BY ingested_at WINDOW w AS (ORDER BY ingested_at)",
    )
    return {(rate_text(int(recoverable), int(prompt)), int(prompt)) for prompt, recoverable in rows if int(prompt) >= min_prompt_tokens}


def sql(agent_url: str, statement: str) -> list[list[Any]]:
    """The rows of ``POST /v1/sql``; raises on a refusal."""
    response = httpx.post(f"{agent_url}/v1/sql", json={"sql": statement}, timeout=10)
    response.raise_for_status()
    return list(response.json()["rows"])


def most_lost(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """The form that lost most tokens in ``tokens_lost`` rows (summed over its reasons; losses
    no form explains left out) and its reason that lost most; a tie goes to the name first in
    alphabetical order, as the dashboard breaks it (:func:`dashboard.losses.most_lost`)."""
    named = [r for r in rows if r["form"] is not None and r["tokens_lost"] > 0]
    assert named, f"no form lost a token: {rows}"
    per_form: dict[str, int] = defaultdict(int)
    for r in named:
        per_form[r["form"]] += int(r["tokens_lost"])
    form = min(per_form, key=lambda f: (-per_form[f], f))
    top = min((r for r in named if r["form"] == form), key=lambda r: (-int(r["tokens_lost"]), r["reason"]))
    return form, str(top["reason"])


def url_params(url: str) -> dict[str, str]:
    """A page URL's query string (one value per name)."""
    return {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items()}


def wait_for_charts(page: Any, timeout_ms: int = 90_000) -> None:
    """Bounded wait until every chart of the page has drawn its axes."""
    page.wait_for_function(CHARTS_DRAWN, timeout=timeout_ms)


def time_axis_labels(page: Any) -> list[str]:
    """The tick labels of every time axis Vega drew on the page (a utc or time scale); also
    checks that no axis at all labels a tick with AM or PM."""
    axes = page.evaluate(AXES)
    twelve_hour = [label for axis in axes for label in axis["labels"] if re.search(r"\b[AP]M\b", label, re.IGNORECASE)]
    assert not twelve_hour, f"12-hour tick labels: {twelve_hour}"
    return [label for axis in axes if re.search(r"for a (utc|time) scale", axis["description"]) for label in axis["labels"]]


def utc_minutes(since: float, until: float) -> set[str]:
    """The UTC clock minutes (``19:50``) and dates (``12-03``) from unix seconds ``since`` to
    ``until``: what a 24-hour UTC tick label of a chart over that span can read."""
    minutes = range(int(since // 60) * 60, int(until) + 60, 60)
    stamps = [datetime.fromtimestamp(t, UTC) for t in minutes]
    return {f"{s:%H:%M}" for s in stamps} | {f"{s:%m-%d}" for s in stamps}


def check_time_axes(page: Any, since: float, what: str) -> int:
    """Every time-axis tick label on ``page`` is 24-hour UTC (``HH:MM``, or the date ``MM-DD``
    at midnight) and names a minute between ``since`` and now (a browser zone other than UTC, or
    a 12-hour clock in the afternoon, would name another); returns how many labels it checked."""
    labels = time_axis_labels(page)
    allowed = utc_minutes(since - 120, time.time() + 120)
    wrong = sorted({label for label in labels if not (CLOCK.fullmatch(label) or DATE.fullmatch(label)) or label not in allowed})
    assert not wrong, f"{what}: time tick labels {wrong} are not 24-hour UTC minutes of this run (of {sorted(set(labels))})"
    return len(labels)
