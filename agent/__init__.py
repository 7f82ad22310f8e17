"""The kvscope sidecar agent (DESIGN.md §6).

The agent is the only process that opens the DuckDB file read-write. Module map:

* :mod:`agent.config` — :class:`~agent.config.AgentConfig` and its YAML loader;
* :mod:`agent.migrations` — the ordered, versioned schema migrations;
* :mod:`agent.store` — the DuckDB store: one writer, a cursor per thread, locked configuration;
* :mod:`agent.ingest` — event batches to Arrow tables, stored idempotently on (engine_id, seq);
* :mod:`agent.metrics` — the Prometheus metrics, on the agent's own registry;
* :mod:`agent.label_cap` — at most N distinct values per free-form label, the rest ``other``;
* :mod:`agent.bulk_histogram`, :mod:`agent.batch_summary` — batch-at-a-time histograms, and what
  a batch adds to the metrics (computed in the decode worker);
* :mod:`agent.process_metrics` — process memory and start time, DuckDB's memory, at scrape time;
* :mod:`agent.sql` — the read-only SQL sandbox (row cap, time limit, renderers);
  :mod:`agent.sql_check` — its statement check (admission);
* :mod:`agent.queries` — named, parameterised queries for the dashboard and alerts;
* :mod:`agent.app` — the FastAPI application (HTTP endpoints);
* :mod:`agent.server` — :func:`~agent.server.serve`, what ``kvscope agent`` runs;
* :mod:`agent.client` — the HTTP client the CLI and the dashboard use.

Importing this package imports nothing heavy; import the submodules you need.
"""
