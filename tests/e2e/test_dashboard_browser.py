"""The dashboard in a real browser (issue 8): Playwright for Python drives Debian's Chromium
(``/usr/bin/chromium``; no browser download) against a ``kvscope up`` replaying the bundled real
trace. Every page renders its charts or tables (waited for, never a fixed sleep), a filter change
updates the page and the URL, the Overview's link from its widest raw − recoverable gap opens the Requests page
on that bucket, and a screenshot of every page is saved under
``$KVSCOPE_ARTIFACTS`` (default ``test-artifacts/``) as the test's artifacts.

Run it as ``make test`` does (``python -m pytest``): it imports the shared test helpers.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.agent_process import ROOT, agent_env
from tests.e2e.procs import start, stop, wait_for
from tests.helpers import free_port

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
MISSING = "install Debian's `chromium` package (`apt-get install chromium`; `make test` does it as root)"
PAGES = {
    "": '[data-testid="stVegaLiteChart"]',  # the Overview, the default page
    "forms": '[data-testid="stVegaLiteChart"]',
    "requests": '[data-testid="stDataFrame"]',
    "alerts": '[data-testid="stDataFrame"], [data-testid="stAlertContentSuccess"]',
    "sql": '[data-testid="stExpander"]',
    "capacity": '[data-testid="stDataFrame"]',
}
"""Page path → what shows that its content rendered (a chart, a table, the schema)."""
TITLES = {"": "Overview", "sql": "SQL"}
REQUESTS = 40
DONE = '.stApp[data-test-script-state="notRunning"]'
"""Streamlit's marker that the page's script run finished (so every panel has been drawn)."""


def artifacts() -> Path:
    folder = Path(os.environ.get("KVSCOPE_ARTIFACTS", ROOT / "test-artifacts")) / "dashboard"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not found: {MISSING}")
def test_every_page_renders_in_chromium(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed (pip install '.[test]')")
    agent_port, dashboard_port = free_port(), free_port()
    agent_url, dashboard_url = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{dashboard_port}"
    up = start(
        [
            sys.executable, "-m", "kvscope", "up", "--data-dir", str(tmp_path / "data"), "--agent-port", str(agent_port),
            "--dashboard-port", str(dashboard_port), "--max-requests", str(REQUESTS),
        ],
        tmp_path / "up.log",
        cwd=ROOT,
        env=agent_env(),
    )  # fmt: skip
    shots = artifacts()
    try:
        # bounded: the replay's requests are all stored (the rollup folds lookups every 10 s)
        wait_for(
            "the replay stored in the agent", up, 300,
            lambda: _count(agent_url, "SELECT count(*) FROM requests") >= REQUESTS
            and _count(agent_url, "SELECT count(*) FROM cache_minute") > 0
            and _count(agent_url, "SELECT count(*) FROM engine_stats") > 0,
        )  # fmt: skip
        wait_for("the dashboard", up, 60, lambda: httpx.get(f"{dashboard_url}/_stcore/health", timeout=2).status_code == 200)
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                for path, ready in PAGES.items():
                    page.goto(f"{dashboard_url}/{path}?window=1+hour", wait_until="domcontentloaded")
                    page.wait_for_selector(ready, state="visible", timeout=90_000)
                    page.wait_for_selector(DONE, timeout=90_000)
                    title = page.locator("h1").first
                    title.wait_for(timeout=30_000)
                    assert title.inner_text().strip() == TITLES.get(path, path.capitalize()), path
                    assert page.get_by_text("Page not found").count() == 0, path
                    assert page.locator('[data-testid="stException"]').count() == 0, f"{path}: an exception is shown"
                    page.screenshot(path=str(shots / f"{path or 'overview'}.png"), full_page=True)
                # a filter change updates the page and the URL, and survives a switch of page
                page.goto(f"{dashboard_url}/", wait_until="domcontentloaded")
                page.wait_for_selector(PAGES[""], state="visible", timeout=90_000)
                page.wait_for_selector(DONE, timeout=90_000)
                sidebar = page.locator('[data-testid="stSidebar"]')
                window = sidebar.locator('[data-testid="stSelectbox"]').first
                window.click()
                page.get_by_role("option", name="5 minutes", exact=True).click()
                page.wait_for_url("**window=5+minutes**", timeout=30_000)
                page.wait_for_selector(DONE, timeout=90_000)
                sync_api.expect(window.get_by_role("combobox")).to_have_value("5 minutes", timeout=30_000)
                assert page.locator('[data-testid="stException"]').count() == 0
                page.screenshot(path=str(shots / "overview-5-minutes.png"), full_page=True)
                sidebar.get_by_role("link", name="Capacity").click()
                page.wait_for_url("**/capacity**", timeout=30_000)
                page.wait_for_selector(PAGES["capacity"], state="visible", timeout=90_000)
                page.wait_for_selector(DONE, timeout=90_000)
                assert "window=5+minutes" in page.url, page.url
                sync_api.expect(sidebar.locator('[data-testid="stSelectbox"]').first.get_by_role("combobox")).to_have_value("5 minutes", timeout=30_000)
                page.screenshot(path=str(shots / "capacity-5-minutes.png"), full_page=True)
                # the drill: the Overview's widest raw − recoverable gap opens the Requests behind it
                page.goto(f"{dashboard_url}/?window=1+hour", wait_until="domcontentloaded")
                page.wait_for_selector(PAGES[""], state="visible", timeout=90_000)
                page.wait_for_selector(DONE, timeout=90_000)
                page.get_by_role("link", name="The requests behind the widest raw − recoverable gap").click()
                page.wait_for_url("**/requests?**start=**", timeout=30_000)
                page.wait_for_selector(PAGES["requests"], state="visible", timeout=90_000)
                page.wait_for_selector(DONE, timeout=90_000)
                assert "window=1+hour" in page.url, page.url  # the filters came along
                sync_api.expect(sidebar.locator('[data-testid="stSelectbox"]').first.get_by_role("combobox")).to_have_value("1 hour", timeout=30_000)
                caption = page.get_by_text("requests in ", exact=False).first
                assert " UTC, newest first." in caption.inner_text(), caption.inner_text()
                assert page.locator('[data-testid="stException"]').count() == 0
                page.screenshot(path=str(shots / "requests-widest-gap.png"), full_page=True)
            finally:
                browser.close()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 60
            while up.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        stop(up)
    for path in PAGES:
        name = path or "overview"
        assert (shots / f"{name}.png").stat().st_size > 10_000, f"{name}.png looks empty"


def _count(agent_url: str, sql: str) -> int:
    response = httpx.post(f"{agent_url}/v1/sql", json={"sql": sql}, timeout=5)
    return int(response.json()["rows"][0][0]) if response.status_code == 200 else 0
