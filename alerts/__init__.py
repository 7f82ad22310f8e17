"""kvscope alerts (DESIGN.md §7, issue 7).

* :mod:`alerts.rulefile` — rule files (Prometheus-shaped YAML, built-in kinds), loaded strictly;
* :mod:`alerts.inputs` — each rule's windowed inputs, queried from the agent's store;
* :mod:`alerts.rule_eval` — the pure evaluator ``evaluate(rules, data, now, previous_state)``;
* :mod:`alerts.rule_scheduler` — runs the rule groups on their schedules (APScheduler);
* :mod:`alerts.alert_view` — an alert's state as pushed, routed and listed (``GET /v1/alerts``);
* :mod:`alerts.notify_config`, :mod:`alerts.routing`, :mod:`alerts.receivers`,
  :mod:`alerts.notifier` — Alertmanager-shaped routing and delivery;
* :mod:`alerts.alert_store` — what alerting keeps in DuckDB (state, notification log, silences);
* :mod:`alerts.golden` — ``kvscope alerts test``: rules over a golden time series;
* :mod:`alerts.prometheus_export` — the rules as Prometheus alerting rules.
"""
