"""What the alerting keeps in the agent's DuckDB (migrations 4 and 5), and the JSONL log.

* ``alerts`` — the history: one row per evaluator transition (``event = 'transition'``,
  ``state`` firing/resolved), per alert of each delivered notification (``event = 'notified'``,
  with the ``receiver`` and the alert's status in ``state``) and per alert of each notification
  that could not be delivered (``event = 'delivery_failed'``, with the ``error``);
* ``alert_state`` — the evaluator's state per alert (pending since, firing since, last value), so
  a restart neither re-pages nor loses pending time;
* ``alert_groups`` — the notification log: per aggregation group, when it was created and last
  notified and which alerts that notification held as firing (with their labels, so a resolve
  can be sent even after the alert's state is gone) — Alertmanager's ``nflog``;
* ``alert_silences`` — silences created through the agent's API or ``kvscope alerts silence``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from agent.ingest import registered
from agent.store import Store, to_timestamp
from alerts.routing import GroupState, Matcher, Silence, parse_matcher
from alerts.rule_eval import AlertState, Status

ALERT_COLUMNS = pa.schema(
    [
        ("ts", pa.timestamp("us")),
        ("alert", pa.string()),
        ("fingerprint", pa.string()),
        ("state", pa.string()),
        ("value", pa.float64()),
        ("labels", pa.string()),
        ("summary", pa.string()),
        ("description", pa.string()),
        ("event", pa.string()),
        ("receiver", pa.string()),
        ("error", pa.string()),
    ]
)
"""The columns of the ``alerts`` table."""

EVENTS = ("transition", "notified", "delivery_failed")


def alert_row(
    *, at: float, alert: str, fingerprint: str, state: str, value: float | None,
    labels: Mapping[str, str], summary: str, description: str,
    event: str = "transition", receiver: str | None = None, error: str | None = None,
) -> dict[str, object]:  # fmt: skip
    """One ``alerts`` row at ``at`` (unix seconds)."""
    if event not in EVENTS:
        raise ValueError(f"unknown alerts event {event!r}")
    return {
        "ts": to_timestamp(at),
        "alert": alert,
        "fingerprint": fingerprint,
        "state": state,
        "value": value,
        "labels": json.dumps(dict(labels), sort_keys=True),
        "summary": summary,
        "description": description,
        "event": event,
        "receiver": receiver,
        "error": error,
    }


def insert_alert_rows(cur: duckdb.DuckDBPyConnection, rows: Sequence[Mapping[str, object]]) -> None:
    """Insert ``alerts`` rows (from :func:`alert_row`) with one statement, inside the caller's
    transaction."""
    if not rows:
        return
    columns = ", ".join(ALERT_COLUMNS.names)
    with registered(cur, "_new_alerts", pa.Table.from_pylist(list(rows), schema=ALERT_COLUMNS)):
        cur.execute(f"INSERT INTO alerts ({columns}) SELECT {columns} FROM _new_alerts")


def append_jsonl(path: Path, lines: Sequence[Mapping[str, object]]) -> None:
    """Append one JSON object per line to ``path`` (created with its folder)."""
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        for line in lines:
            out.write(json.dumps(line, sort_keys=True) + "\n")


# -- evaluator state ---------------------------------------------------------------------------
_STATE_SCHEMA = pa.schema(
    [
        ("fingerprint", pa.string()),
        ("alert", pa.string()),
        ("labels", pa.string()),
        ("series", pa.string()),
        ("status", pa.string()),
        ("active_since", pa.float64()),
        ("firing_since", pa.float64()),
        ("inactive_since", pa.float64()),
        ("resolved_at", pa.float64()),
        ("evaluated_at", pa.float64()),
        ("value", pa.float64()),
        ("updated_at", pa.timestamp("us")),
    ]
)


def load_rule_state(store: Store) -> dict[str, AlertState]:
    """Every alert's state from ``alert_state``."""
    with store.cursor() as cur:
        rows = cur.execute(
            "SELECT fingerprint, alert, labels, series, status, active_since, firing_since, "
            "inactive_since, resolved_at, evaluated_at, value FROM alert_state"
        ).fetchall()
    return {
        fp: AlertState(
            alert=alert,
            fingerprint=fp,
            labels=json.loads(labels),
            series=tuple((k, v) for k, v in json.loads(series)),
            status=Status(status),
            active_since=active,
            firing_since=firing,
            inactive_since=inactive,
            resolved_at=resolved,
            evaluated_at=evaluated,
            value=value,
        )
        for fp, alert, labels, series, status, active, firing, inactive, resolved, evaluated, value in rows
    }


def save_rule_state(
    cur: duckdb.DuckDBPyConnection, before: Mapping[str, AlertState], after: Mapping[str, AlertState], now: float
) -> None:
    """Write the state changes between ``before`` and ``after`` inside the caller's transaction."""
    changed = [st for fp, st in after.items() if before.get(fp) != st]
    dropped = [fp for fp in before if fp not in after]
    if dropped or changed:
        doomed = dropped + [st.fingerprint for st in changed]
        cur.execute("DELETE FROM alert_state WHERE list_contains($fps, fingerprint)", {"fps": doomed})
    if not changed:
        return
    at = to_timestamp(now)
    states = pa.Table.from_pylist(
        [
            {
                "fingerprint": st.fingerprint,
                "alert": st.alert,
                "labels": json.dumps(dict(st.labels), sort_keys=True),
                "series": json.dumps([list(kv) for kv in st.series]),
                "status": st.status.value,
                "active_since": st.active_since,
                "firing_since": st.firing_since,
                "inactive_since": st.inactive_since,
                "resolved_at": st.resolved_at,
                "evaluated_at": st.evaluated_at,
                "value": st.value,
                "updated_at": at,
            }
            for st in changed
        ],
        schema=_STATE_SCHEMA,
    )
    with registered(cur, "_alert_state", states):
        cur.execute(f"INSERT INTO alert_state SELECT {', '.join(_STATE_SCHEMA.names)} FROM _alert_state")


# -- the notification log ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class NotifiedAlert:
    """What a group's last notification said of one firing alert (enough to resolve it later)."""

    alert: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLog:
    """One aggregation group's notification log entry: its routing state, the receiver and
    grouping labels it notifies with, and per integration of that receiver the firing alerts it
    last took and when (Alertmanager's nflog is per receiver integration as well, so a retry after
    one integration failed does not repeat the others)."""

    state: GroupState
    receiver: str
    group_labels: Mapping[str, str]
    delivered: Mapping[str, tuple[frozenset[str], float]]


def load_groups(store: Store) -> tuple[dict[str, GroupLog], dict[str, NotifiedAlert]]:
    """The notification log, and the alerts its groups' last notifications held firing."""
    with store.cursor() as cur:
        rows = cur.execute(
            "SELECT group_key, receiver, group_labels, created_at, last_sent_at, last_firing, delivered FROM alert_groups"
        ).fetchall()
    groups: dict[str, GroupLog] = {}
    notified: dict[str, NotifiedAlert] = {}
    for key, receiver, labels, created, sent, firing_json, delivered_json in rows:
        firing = json.loads(firing_json)
        groups[key] = GroupLog(
            state=GroupState(created_at=created, last_sent_at=sent, last_firing=frozenset(firing)),
            receiver=receiver,
            group_labels=json.loads(labels),
            delivered={name: (frozenset(fps), at) for name, (fps, at) in json.loads(delivered_json).items()},
        )
        for fp, doc in firing.items():
            notified[fp] = NotifiedAlert(
                alert=doc["alert"], labels=doc["labels"], annotations=doc["annotations"], starts_at=doc["starts_at"]
            )
    return groups, notified


def save_groups(
    cur: duckdb.DuckDBPyConnection,
    before: Mapping[str, GroupLog],
    after: Mapping[str, GroupLog],
    notified: Mapping[str, NotifiedAlert],
    now: float,
) -> None:
    """Write the changes between ``before`` and ``after`` inside the caller's transaction;
    ``notified`` must describe every fingerprint in a changed group's ``last_firing``.

    Raises:
        KeyError: a fingerprint ``notified`` does not describe (a caller bug).
    """
    changed = {key: log for key, log in after.items() if before.get(key) != log}
    dropped = [key for key in before if key not in after]
    if dropped or changed:
        cur.execute(
            "DELETE FROM alert_groups WHERE list_contains($keys, group_key)", {"keys": dropped + list(changed)}
        )
    at = to_timestamp(now)
    for key, log in changed.items():
        firing = {
            fp: {
                "alert": notified[fp].alert,
                "labels": dict(notified[fp].labels),
                "annotations": dict(notified[fp].annotations),
                "starts_at": notified[fp].starts_at,
            }
            for fp in sorted(log.state.last_firing)
        }
        delivered = {name: [sorted(fps), sent] for name, (fps, sent) in sorted(log.delivered.items())}
        cur.execute(
            "INSERT INTO alert_groups VALUES ($key, $receiver, $labels, $created, $sent, $firing, $delivered, $at)",
            {
                "key": key,
                "receiver": log.receiver,
                "labels": json.dumps(dict(log.group_labels), sort_keys=True),
                "created": log.state.created_at,
                "sent": log.state.last_sent_at,
                "firing": json.dumps(firing),
                "delivered": json.dumps(delivered),
                "at": at,
            },
        )


# -- silences ----------------------------------------------------------------------------------
class SilenceError(ValueError):
    """A silence request that cannot be taken (bad matcher, bad times, unknown id)."""


def matcher_text(m: Matcher) -> str:
    """``m`` in the syntax :func:`alerts.routing.parse_matcher` reads back (``name="value"``)."""
    escaped = m.value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{m.name}{m.op}"{escaped}"'


def create_silence(
    store: Store,
    *,
    matchers: Sequence[str],
    starts_at: float,
    ends_at: float,
    created_by: str,
    comment: str,
    now: float,
) -> Silence:
    """Store a new silence; returns it (with its new id).

    Raises:
        SilenceError: a matcher does not parse, no matcher would select anything specific,
            the silence ends before it starts or has already ended.
    """
    try:
        parsed = tuple(parse_matcher(text) for text in matchers)
        silence = Silence(
            id=str(uuid.uuid4()), matchers=parsed, starts_at=starts_at, ends_at=ends_at,
            created_by=created_by, comment=comment,
        )  # fmt: skip
    except ValueError as exc:
        raise SilenceError(str(exc)) from None
    if ends_at <= now:
        raise SilenceError("the silence would already have ended")
    with store.transaction() as cur:
        cur.execute(
            "INSERT INTO alert_silences VALUES ($id, $matchers, $starts, $ends, $by, $comment, $at, $at)",
            {
                "id": silence.id,
                "matchers": json.dumps([[m.name, m.op, m.value] for m in parsed], ensure_ascii=False),
                "starts": starts_at,
                "ends": ends_at,
                "by": created_by,
                "comment": comment,
                "at": to_timestamp(now),
            },
        )
    return silence


def expire_silence(store: Store, silence_id: str, *, now: float) -> Silence:
    """End a silence now (an already ended one is left as it is); returns it.

    Raises:
        SilenceError: no silence has this id.
    """
    with store.transaction() as cur:
        found = cur.execute("SELECT ends_at FROM alert_silences WHERE id = $id", {"id": silence_id}).fetchall()
        if not found:
            raise SilenceError(f"no silence with id {silence_id!r}")
        if found[0][0] > now:  # a pending one is expired too: it ends now, before it would start
            cur.execute(
                "UPDATE alert_silences SET starts_at = least(starts_at, $now - 0.001), ends_at = $now, "
                "updated_at = $at WHERE id = $id",
                {"id": silence_id, "now": now, "at": to_timestamp(now)},
            )
    return next(s for s in load_silences(store) if s.id == silence_id)


def load_silences(store: Store, *, ended_after: float | None = None) -> list[Silence]:
    """Every stored silence (only those ending after ``ended_after`` when given), by start."""
    with store.cursor() as cur:
        rows = cur.execute(
            "SELECT id, matchers, starts_at, ends_at, created_by, comment FROM alert_silences "
            "WHERE $after::DOUBLE IS NULL OR ends_at > $after::DOUBLE ORDER BY starts_at, id",
            {"after": ended_after},
        ).fetchall()
    return [
        Silence(
            id=sid,
            matchers=tuple(Matcher(name, op, value) for name, op, value in json.loads(matchers)),
            starts_at=starts,
            ends_at=ends,
            created_by=by,
            comment=comment,
        )
        for sid, matchers, starts, ends, by, comment in rows
    ]


def silence_json(s: Silence, now: float) -> dict[str, object]:
    """A silence as the API answers it (Alertmanager's ``status.state``: pending, active, expired)."""
    state = "pending" if now < s.starts_at else "active" if s.active(now) else "expired"
    return {
        "id": s.id,
        "matchers": [matcher_text(m) for m in s.matchers],
        "starts_at": s.starts_at,
        "ends_at": s.ends_at,
        "created_by": s.created_by,
        "comment": s.comment,
        "state": state,
    }
