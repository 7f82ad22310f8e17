"""Every flag of the ``kvscope`` command line has help text, and every flag with a default that
means something shows it (``(default: %(default)s)`` or a sentence saying what the default is).

The parser is walked recursively, every subcommand and sub-subcommand, so flags added later are
held to the same rule. A flag may hide itself deliberately with ``help=argparse.SUPPRESS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kvscope.cli_parser import build_parser


def parsers(parser: argparse.ArgumentParser, prog: str = "kvscope") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command line, parser)`` for ``parser`` and every subparser below it, depth first."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias names the same parser again
                    seen.add(id(sub))
                    yield from parsers(sub, f"{prog} {name}")


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's flags (actions with option strings), without ``-h/--help``."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def meaningful_default(action: argparse.Action) -> bool:
    """A default the user should see: not absent (None, SUPPRESS) nor an unset switch (False).
    Compared by identity: 0 and 0.0 are real defaults even though they equal False."""
    default = action.default
    return not (default is None or default is False or default is argparse.SUPPRESS)


def test_the_walk_reaches_every_subcommand() -> None:
    found = {prog for prog, _ in parsers(build_parser())}
    for prog in ("kvscope up", "kvscope agent", "kvscope dashboard", "kvscope replay", "kvscope serve",
                 "kvscope bench ttft", "kvscope sql", "kvscope alerts test", "kvscope alerts silence add"):  # fmt: skip
        assert prog in found
    flags = {flag for _, p in parsers(build_parser()) for a in options(p) for flag in a.option_strings}
    assert {"--agent-port", "--dashboard-port", "--port", "--host", "--prefix-tokens", "--duration"} <= flags


def test_every_flag_has_help_text() -> None:
    missing = [
        f"{prog} {'/'.join(action.option_strings)}"
        for prog, parser in parsers(build_parser())
        for action in options(parser)
        if action.help is None or not action.help.strip()
    ]
    assert not missing, f"flags without help text (give help=..., or help=argparse.SUPPRESS to hide one): {missing}"


def test_every_flag_with_a_default_shows_it() -> None:
    silent = [
        f"{prog} {'/'.join(action.option_strings)} (default {action.default!r})"
        for prog, parser in parsers(build_parser())
        for action in options(parser)
        if action.help is not None
        and action.help != argparse.SUPPRESS
        and meaningful_default(action)
        and "%(default)" not in action.help
        and "default" not in action.help.lower()
    ]
    assert not silent, f"flags whose help does not show their default (add '(default: %(default)s)'): {silent}"


def test_every_help_page_renders() -> None:
    for prog, parser in parsers(build_parser()):
        assert "usage:" in parser.format_help(), prog  # a bad %(...)s in a help string raises here


def test_the_port_flags_show_their_defaults() -> None:
    pages = {prog: " ".join(p.format_help().split()) for prog, p in parsers(build_parser())}
    assert "(default: 9400)" in pages["kvscope up"] and "(default: 8501)" in pages["kvscope up"]
    assert "(default: 8501)" in pages["kvscope dashboard"] and "(default: 127.0.0.1)" in pages["kvscope dashboard"]
    assert "(default: 8000)" in pages["kvscope serve"] and "(default: 127.0.0.1)" in pages["kvscope serve"]
