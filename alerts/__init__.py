"""kvscope alerts (DESIGN.md §7).

* :mod:`alerts.rules` — the rule model (the built-in :class:`~alerts.rules.RecoverableHitRateRule`);
* :mod:`alerts.evaluator` — the pure evaluator ``evaluate(rules, data, now, previous_state)``;
* :mod:`alerts.scheduler` — the minute job: query the agent's store, evaluate, persist, notify.
"""
