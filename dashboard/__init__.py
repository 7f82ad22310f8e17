"""kvscope's Streamlit dashboard (DESIGN.md §8). It reads only through the agent's HTTP API.

* :mod:`dashboard.client` — the agent client (named queries as DataFrames, readable errors);
* :mod:`dashboard.app` — the entry script (``streamlit run dashboard/app.py -- --agent URL``);
* :mod:`dashboard.common` — the shared client, cached queries and sidebar filters;
* :mod:`dashboard.overview` — the Overview page;
* :mod:`dashboard.alerts_page` — the Alerts page (firing and pending, silences, history);
* :mod:`dashboard.forms_page` — one form: outcomes, reasons, recovery latency, tiers, L* share;
* :mod:`dashboard.requests_page` — recent requests and one request's forms against L*;
* :mod:`dashboard.sql_page` — the SQL console;
* :mod:`dashboard.capacity_page` — pools per form and tier, GPUs;
* :mod:`dashboard.launch` — the command line the CLI spawns.
"""
