"""Tokens lost by the form that limited the resume point and its reason (the ``tokens_lost``
named query, :mod:`agent.queries_loss`): the Overview's chart and link, the Forms page's default
form and its reasons ranked.

A tie (several forms stopped at the same resume point) counts the request's lost tokens under
every tied form; the tied part of each bar is drawn lighter and named in the tooltip, so a tie
reads as a tie and the bars add up to more than the tokens lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import altair as alt
import pandas as pd

from dashboard.palette import FORM_COLORS, reason_label

NO_FORM = "(no form)"
"""The label of losses no form explains (the admission chose to recompute, say)."""


@dataclass(frozen=True, slots=True)
class MostLost:
    """The form that lost most tokens in a window (summed over its reasons, ties included) and,
    within it, the reason that lost most."""

    form: str
    reason: str
    form_tokens: int
    reason_tokens: int


def most_lost(table: pd.DataFrame) -> MostLost | None:
    """The form with the largest ``tokens_lost`` sum over its rows of ``table`` (``tokens_lost``
    rows; losses without a form left out), then its reason with the most; ties between names go
    to the first in alphabetical order. None when no form lost a token."""
    named = table[table["form"].notna() & (table["tokens_lost"] > 0)] if not table.empty else table
    if named.empty:
        return None
    per_form = named.groupby("form", as_index=False)["tokens_lost"].sum().sort_values(["tokens_lost", "form"], ascending=[False, True])
    form = str(per_form.iloc[0]["form"])
    reasons = named[named["form"] == form].sort_values(["tokens_lost", "reason"], ascending=[False, True])
    top = reasons.iloc[0]
    return MostLost(form=form, reason=str(top["reason"]), form_tokens=int(per_form.iloc[0]["tokens_lost"]), reason_tokens=int(top["tokens_lost"]))


def loss_parts(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` as bar segments: per form and reason, the tokens lost alone and in ties
    (``part``), with the readable reason label and the form's total (the sort key)."""
    if table.empty:
        return pd.DataFrame(columns=["form", "reason", "reason_label", "part", "tokens", "requests", "form_total"])
    rows = table.assign(form=table["form"].fillna(NO_FORM))
    totals = rows.groupby("form")["tokens_lost"].sum()
    parts = []
    for r in rows.itertuples(index=False):
        alone = int(r.tokens_lost) - int(r.tied_tokens_lost)
        for part, tokens, requests in (("alone", alone, int(r.requests) - int(r.tied_requests)), ("tied", int(r.tied_tokens_lost), int(r.tied_requests))):
            if tokens > 0:
                parts.append(
                    {
                        "form": r.form,
                        "reason": r.reason,
                        "reason_label": reason_label(str(r.reason)),
                        "part": part,
                        "tokens": tokens,
                        "requests": requests,
                        "form_total": int(totals[r.form]),
                    }
                )
    return pd.DataFrame(parts, columns=["form", "reason", "reason_label", "part", "tokens", "requests", "form_total"])


def losses_chart(table: pd.DataFrame) -> alt.Chart:
    """Horizontal bars: one per form (most lost on top), stacked by reason, the tied part lighter."""
    parts = loss_parts(table)
    order = parts.drop_duplicates("form").sort_values(["form_total", "form"], ascending=[False, True])["form"].tolist()
    return (
        alt.Chart(parts)
        .mark_bar()
        .encode(
            y=alt.Y("form:N", sort=order, title=None, axis=alt.Axis(labelLimit=300)),
            x=alt.X("tokens:Q", stack=True, title="tokens lost (hash hit, not recoverable)"),
            color=alt.Color("reason_label:N", title="reason", legend=alt.Legend(labelLimit=400, orient="bottom", columns=2)),
            opacity=alt.Opacity("part:N", scale=alt.Scale(domain=["alone", "tied"], range=[1.0, 0.45]), title="limit"),
            stroke=alt.Stroke("form:N", scale=alt.Scale(domain=list(FORM_COLORS), range=list(FORM_COLORS.values())), legend=None),
            tooltip=["form:N", alt.Tooltip("reason_label:N", title="reason"), alt.Tooltip("part:N", title="limit"), "tokens:Q", "requests:Q"],
        )
    )


def reason_ranking(table: pd.DataFrame, form: str) -> pd.DataFrame:
    """``form``'s reasons, most tokens lost first: reason, label, tokens lost, their share of the
    form's, the cumulative share, requests and the tied part."""
    mine = table[table["form"] == form].sort_values(["tokens_lost", "reason"], ascending=[False, True]) if not table.empty else table
    out = pd.DataFrame(
        {
            "reason": mine.get("reason", pd.Series(dtype=str)),
            "label": [reason_label(str(r)) for r in mine.get("reason", [])],
            "tokens_lost": mine.get("tokens_lost", pd.Series(dtype="int64")),
            "requests": mine.get("requests", pd.Series(dtype="int64")),
            "tied_requests": mine.get("tied_requests", pd.Series(dtype="int64")),
            "tied_tokens_lost": mine.get("tied_tokens_lost", pd.Series(dtype="int64")),
        }
    ).reset_index(drop=True)
    total = out["tokens_lost"].sum()
    out["share"] = out["tokens_lost"] / total if total else 0.0
    out["cumulative_share"] = out["share"].cumsum()
    return out
