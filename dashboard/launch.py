"""The command line that starts the dashboard (what ``kvscope dashboard`` / ``kvscope up`` spawn)."""

from __future__ import annotations

import sys
from pathlib import Path

APP_PATH = Path(__file__).resolve().parent / "app.py"
"""The Streamlit entry script."""


def streamlit_command(agent_url: str, port: int, address: str = "127.0.0.1") -> list[str]:
    """``python -m streamlit run <app.py> --server.headless true --server.port P
    --server.address A --browser.gatherUsageStats false --client.toolbarMode minimal -- --agent
    URL``, with this interpreter (``minimal``: an operator's page has no "Deploy" button).

    Raises:
        ValueError: ``port`` outside 1..65535, or an empty ``agent_url``/``address``.
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    if not agent_url:
        raise ValueError("agent_url must not be empty")
    if not address:
        raise ValueError("address must not be empty")
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        address,
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",
        "--",
        "--agent",
        agent_url,
    ]
