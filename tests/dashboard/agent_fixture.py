"""A real agent for dashboard tests: the FastAPI app under uvicorn in a thread, on a free
127.0.0.1 port, over a store in a temporary folder; stopped and closed on exit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from streamlit.testing.v1 import AppTest

from agent.app import create_app
from agent.config import AgentConfig
from agent.store import Store


@dataclass(frozen=True, slots=True)
class RunningAgent:
    url: str
    app: FastAPI
    store: Store


@contextmanager
def running_agent(folder: Path, **settings: Any) -> Iterator[RunningAgent]:
    """Serve a fresh agent storing under ``folder`` (other ``AgentConfig`` fields from
    ``settings``) until the block ends."""
    config = AgentConfig(data_dir=folder, port=0, decode_processes=0, **settings)
    store = Store.open(config.db_path)
    app = create_app(config, store, environ={})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "agent did not start"
            time.sleep(0.01)
        yield RunningAgent(url=f"http://127.0.0.1:{port}", app=app, store=store)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        store.close()


def render_page(module: str, agent_url: str, monkeypatch: pytest.MonkeyPatch, **query: str) -> AppTest:
    """Run one dashboard page (``dashboard.<module>.render()``) against ``agent_url``, with
    ``query`` as the URL's query string."""
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent_url)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    at = AppTest.from_string(f"from dashboard import {module}\n{module}.render()\n", default_timeout=30)
    for name, value in query.items():
        at.query_params[name] = value
    return at.run()
