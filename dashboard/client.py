"""How the dashboard finds its agent, and named queries as DataFrames.

The dashboard never opens the DuckDB file: every figure comes from a named query through
:class:`agent.client.AgentClient`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

import pandas as pd

from agent.client import TOKEN_ENV, AgentClient, AgentError, default_agent_url, query_timeout_for

__all__ = ["AgentClient", "AgentError", "client_from", "query_frame", "query_timeout_for", "resolve_agent_url"]


def resolve_agent_url(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> str:
    """The agent URL: ``--agent URL`` in ``argv`` (the script arguments after ``--`` of
    ``streamlit run``), else ``KVSCOPE_AGENT_URL``, else the default. Other arguments are
    ignored."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--agent", default=None)
    known, _ = parser.parse_known_args(list(argv))
    return known.agent or default_agent_url(environ)


def client_from(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> AgentClient:
    """The client for this dashboard process (URL as :func:`resolve_agent_url`, token from
    ``KVSCOPE_TOKEN``)."""
    return AgentClient(base_url=resolve_agent_url(argv, environ), token=environ.get(TOKEN_ENV) or None)


def query_frame(client: AgentClient, name: str, **params: object) -> pd.DataFrame:
    """A named query's rows as a DataFrame (column order and types kept).

    Raises:
        agent.client.AgentError: the agent is unreachable or refused the query.
    """
    return client.query_table(name, **params).to_pandas()
