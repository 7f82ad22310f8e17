"""The per-form summary ``kvscope up`` and ``kvscope replay`` print at the end.

For ``kvscope up`` it is computed from the events the agent stored (named queries ``totals``,
``tokens_lost`` and ``form_outcomes``), so it shows what operators will query; ``kvscope replay``
without an agent computes the same figures in-process. It leads with the tokens lost, ranked by
the form that limited the resume point and its reason (a tie counted under every tied form, as
the dashboard does), then the lookups per form and outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from agent.client import AgentClient
from engine.events import Form, Outcome
from engine.trace.replay import ReplayTally

TOKEN_FIELDS = ("prompt_tokens", "hash_hit_tokens", "recoverable_tokens", "replayed_tokens", "recomputed_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """Totals over one engine's requests, and ``forms``: form → outcome → lookup count."""

    requests: int
    prompt_tokens: int
    hash_hit_tokens: int
    recoverable_tokens: int
    replayed_tokens: int
    recomputed_tokens: int
    forms: dict[str, dict[str, int]]
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    losses: list[dict[str, Any]] = field(default_factory=list)
    """Tokens lost per limiting form (None: no form) and reason, most first: ``form``, ``reason``,
    ``tokens_lost``, ``requests``, ``tied_requests``."""

    @property
    def raw_hit_rate(self) -> float | None:
        return self.hash_hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def recoverable_hit_rate(self) -> float | None:
        return self.recoverable_tokens / self.prompt_tokens if self.prompt_tokens else None

    @classmethod
    def from_agent(cls, client: AgentClient, engine_id: str, run_id: str | None = None) -> Summary:
        """Read the stored events of ``engine_id`` back from the agent (of its run ``run_id`` only,
        when given: a stable engine id spans runs)."""
        totals = client.query("totals", engine_id=engine_id, run_id=run_id)[0]
        forms: dict[str, dict[str, int]] = {}
        reasons: dict[str, dict[str, int]] = {}
        for row in client.query("form_outcomes", engine_id=engine_id, run_id=run_id):
            form, outcome, reason, n = row["form"], row["outcome"], row["reason"], int(row["lookups"])
            forms.setdefault(form, {str(o): 0 for o in Outcome})[outcome] += n
            if outcome != Outcome.HIT:
                reasons.setdefault(form, {})
                reasons[form][reason] = reasons[form].get(reason, 0) + n
        losses = [
            {k: row[k] if k in ("form", "reason") else int(row[k]) for k in LOSS_FIELDS}
            for row in client.query("tokens_lost", engine_id=engine_id, run_id=run_id)
        ]
        return cls(
            requests=int(totals["requests"]),
            **{k: int(totals[k]) for k in TOKEN_FIELDS},
            forms=_ordered(forms),
            reasons=_ordered(reasons),
            losses=_ranked(losses),
        )

    @classmethod
    def from_tally(cls, tally: ReplayTally) -> Summary:
        return cls(
            requests=tally.requests,
            **{k: int(getattr(tally, k)) for k in TOKEN_FIELDS},
            forms=_ordered(tally.outcome_counts()),
            reasons=_ordered({f: dict(c) for f, c in tally.reasons.items()}),
            losses=_ranked(
                [
                    {"form": form, "reason": reason, "tokens_lost": t[0], "requests": t[1], "tied_requests": t[2]}
                    for (form, reason), t in tally.losses.items()
                ]
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            **{k: getattr(self, k) for k in TOKEN_FIELDS},
            "raw_hit_rate": self.raw_hit_rate,
            "recoverable_hit_rate": self.recoverable_hit_rate,
            "forms": self.forms,
            "reasons": self.reasons,
            "losses": self.losses,
        }

    def render(self, console: Console) -> None:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"

        console.print(
            f"[bold]{self.requests}[/] requests, {self.prompt_tokens} prompt tokens: "
            f"raw (hash) hit rate {pct(self.raw_hit_rate)}, recoverable hit rate "
            f"[bold]{pct(self.recoverable_hit_rate)}[/] "
            f"(recoverable {self.recoverable_tokens} / replayed {self.replayed_tokens} / "
            f"recomputed {self.recomputed_tokens} tokens)"
        )
        if self.losses:
            lost = Table(title="tokens lost (hash hit, not recoverable) by limiting form and reason, most first")
            for column in ("form", "reason", "tokens lost", "requests", "of them tied"):
                lost.add_column(column, justify="left" if column in ("form", "reason") else "right")
            for row in self.losses:
                lost.add_row(row["form"] or "(no form)", row["reason"], str(row["tokens_lost"]), str(row["requests"]), str(row["tied_requests"]))
            console.print(lost)
            console.print("A request whose forms tied at its resume point counts under each tied form.")
        table = Table(title="cache lookups per form")
        table.add_column("form")
        for o in Outcome:
            table.add_column(str(o), justify="right")
        for form, counts in self.forms.items():
            table.add_row(form, *(str(counts.get(str(o), 0)) for o in Outcome))
        console.print(table)
        why = Table(title="lookups that were not a hit, by reason")
        why.add_column("form")
        why.add_column("reason")
        why.add_column("lookups", justify="right")
        for form, reasons in self.reasons.items():
            for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
                why.add_row(form, reason, str(n))
        if why.row_count:
            console.print(why)


LOSS_FIELDS = ("form", "reason", "tokens_lost", "requests", "tied_requests")


def _ranked(losses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Most tokens lost first; then by form (no form last) and reason, so the order is stable."""
    return sorted(losses, key=lambda r: (-r["tokens_lost"], r["form"] is None, r["form"] or "", r["reason"]))


def _ordered(by_form: dict[str, Any]) -> dict[str, Any]:
    order = [str(f) for f in Form]
    return {k: by_form[k] for k in sorted(by_form, key=lambda f: order.index(f) if f in order else len(order))}
