"""kvscope: a hybrid-attention engine with a per-form prefix cache, its telemetry agent, alerts and dashboard.

The command line of docs/design.md §10.

Every subcommand parses its flags here and calls into the package that does the work. User
errors (a bad trace, bad SQL, a bad config, a locked database) print one clear line on stderr
and exit with status 2; a failed service exits 1.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from kvscope.cli_args import UserError
from kvscope.cli_parser import build_parser
from kvscope.commands_engine import cmd_bench, cmd_generate, cmd_replay, cmd_serve, cmd_up
from kvscope.commands_ops import cmd_agent, cmd_alerts, cmd_dashboard, cmd_sql

__all__ = ["COMMANDS", "UserError", "build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code = COMMANDS[args.command](args)
    except UserError as exc:
        print(f"kvscope {args.command}: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


COMMANDS = {
    "alerts": cmd_alerts,
    "bench": cmd_bench,
    "up": cmd_up,
    "agent": cmd_agent,
    "dashboard": cmd_dashboard,
    "replay": cmd_replay,
    "generate": cmd_generate,
    "serve": cmd_serve,
    "sql": cmd_sql,
}
