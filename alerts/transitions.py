"""What one rule-group evaluation writes: its state changes and transitions in one store
transaction (``alert_state`` and ``alerts``, :mod:`alerts.alert_store`), and the transition log
(``alerts.log``, one JSON line per firing or resolve)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.store import Store
from alerts.alert_store import alert_row, append_jsonl, insert_alert_rows, save_rule_state
from alerts.rule_eval import AlertState, Notification


def save(store: Store, before: dict[str, AlertState], after: dict[str, AlertState], notes: Sequence[Notification], now: float) -> None:
    """Write the state changes between ``before`` and ``after`` and the transitions, in one
    transaction."""
    if not notes and all(before.get(fp) == st for fp, st in after.items()) and set(before) <= set(after):
        return
    alerts = [
        alert_row(
            at=n.at, alert=n.alert, fingerprint=n.fingerprint, state=n.status.value, value=n.value, labels=n.labels,
            summary=n.annotations.get("summary", ""), description=n.annotations.get("description", ""),
        )
        for n in notes
    ]
    with store.transaction() as cur:
        save_rule_state(cur, before, after, now)
        insert_alert_rows(cur, alerts)


def append_log(path: Path, notes: Sequence[Notification]) -> None:
    """The transition log: one JSON line per firing or resolve."""
    append_jsonl(
        path,
        [
            {
                "at": n.at,
                "alert": n.alert,
                "fingerprint": n.fingerprint,
                "status": n.status.value,
                "labels": dict(n.labels),
                "value": n.value,
                "annotations": dict(n.annotations),
            }
            for n in notes
        ],
    )
