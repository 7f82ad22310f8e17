"""The Grafana dashboard over the agent's Prometheus metrics, built with grafana-foundation-sdk
and written to ``dashboards/grafana/kvscope.json`` (the file ``docker/compose.yaml`` provisions).

The panels and their PromQL are :mod:`kvscope.grafana_panels`; this module turns them into the
SDK's builders: a dashboard (uid ``kvscope``, UTC, shared crosshair) with a Prometheus data
source variable (``datasource``) every panel queries through, the template variables
``engine``, ``model`` and ``form`` (multi-value, "All" is ``.*``), and one row per
:class:`~kvscope.grafana_panels.RowSpec`.

Regenerate the committed file with ``make grafana`` (``python -m kvscope.grafana_dashboard``);
``--check`` exits 1 when the file differs from what this module builds (docs/grafana.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import common, dashboard

from kvscope.grafana_panels import ROWS, PanelSpec, RowSpec

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "dashboards" / "grafana" / "kvscope.json"
"""Where the generated dashboard is committed (a source checkout's ``dashboards/grafana/``)."""
UID = "kvscope"
DATASOURCE_VARIABLE = "datasource"
DATASOURCE = dashboard.DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE_VARIABLE + "}")
"""Every panel's data source: the one chosen in the ``datasource`` variable."""
ALL = dashboard.VariableOption(selected=True, text="All", value="$__all")

QUERY_VARIABLES = (
    ("engine", "Engine", "label_values(kvscope_requests_total, engine)"),
    ("model", "Model", 'label_values(kvscope_requests_total{engine=~"$engine"}, model)'),
    ("form", "Form", 'label_values(kvscope_cache_lookups_total{engine=~"$engine", model=~"$model"}, form)'),
)
"""The query template variables: name, label, Prometheus ``label_values`` query."""


def _query_variable(name: str, label: str, query: str) -> dashboard_builders.QueryVariable:
    return (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
    )


def _query(ref_id: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(ref_id).expr(expr).legend_format(legend).range().datasource(DATASOURCE)


def _stat(spec: PanelSpec, width: int) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(width)
        .height(4)
        .graph_mode(common.BigValueGraphMode.NONE)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    for target in spec.targets:
        panel = panel.with_target(_query(target.ref_id, target.expr, target.legend))
    return panel


def _timeseries(spec: PanelSpec, width: int) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(width)
        .height(8)
        .min(0)
        .fill_opacity(30 if spec.stack else 0)
        .span_nulls(False)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE))
    )
    if spec.stack:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    for target in spec.targets:
        panel = panel.with_target(_query(target.ref_id, target.expr, target.legend))
    return panel


def _add_row(builder: dashboard_builders.Dashboard, row: RowSpec) -> dashboard_builders.Dashboard:
    builder = builder.with_row(dashboard_builders.Row(row.title))
    for spec in row.panels:
        width = 24 // 4 if spec.kind == "stat" else row.width
        builder = builder.with_panel(_stat(spec, width) if spec.kind == "stat" else _timeseries(spec, width))
    return builder


def build_dashboard(rows: Sequence[RowSpec] = ROWS) -> dashboard.Dashboard:
    """The dashboard (the SDK's model) with ``rows``; panel ids are numbered 1.. top to bottom."""
    builder = (
        dashboard_builders.Dashboard("kvscope")
        .uid(UID)
        .description("kvscope's cache decisions, ingest health and alerts from the agent's Prometheus metrics.")
        .tags(["kvscope"])
        .timezone(common.TimeZoneUtc)
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
        .readonly()
        .with_variable(
            dashboard_builders.DatasourceVariable(DATASOURCE_VARIABLE).label("Prometheus").type("prometheus")
        )
    )
    for name, label, query in QUERY_VARIABLES:
        builder = builder.with_variable(_query_variable(name, label, query))
    for row in rows:
        builder = _add_row(builder, row)
    built = builder.build()
    for number, panel in enumerate(built.panels or [], start=1):
        panel.id_val = number
    return built


def to_json(model: dashboard.Dashboard) -> str:
    """``model`` as the text of the committed file: 2-space indented JSON, keys sorted, a final
    newline (so a regenerated file differs only where the dashboard did)."""
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def load_dashboard(path: Path = DASHBOARD_PATH) -> dashboard.Dashboard:
    """Read a dashboard JSON file back into the SDK's types (panels, options and Prometheus
    queries decoded by their registered plugins).

    Raises:
        OSError: the file cannot be read. json.JSONDecodeError: it is not JSON.
        ValueError: it is JSON but not a dashboard object.
    """
    data: Any = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a dashboard is a JSON object, got {type(data).__name__}")
    register_default_plugins()
    return dashboard.Dashboard.from_json(data)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the dashboard to ``--out`` (default :data:`DASHBOARD_PATH`), or with ``--check``
    only compare it; returns the exit status (1: the file is missing or differs)."""
    parser = argparse.ArgumentParser(prog="python -m kvscope.grafana_dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DASHBOARD_PATH, help="the JSON file (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the generator's output")
    args = parser.parse_args(argv)
    text = to_json(build_dashboard())
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            print(f"{args.out} is out of date: run `make grafana`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
