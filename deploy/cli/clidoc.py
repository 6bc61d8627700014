"""The command-line reference, generated from the argparse parsers: docs/cli.md.

Nothing here lists flags by hand.  `fedhop` is one top-level parser (deploy/cli/cli.py) whose
sub-commands, except `run`, each hand their arguments to their own module's `main`, which builds
its own parser there (deploy/tools/sweep.py, deploy/tools/report.py, ...).  So the reference asks each
command for its parser the way a user's command line reaches it: it calls `cli.main([COMMAND])`
with `ArgumentParser.parse_args` replaced by a function that hands back the parser instead of
parsing.  Nothing runs: every command builds its parser before it does anything else.  The
page then lists, per command and sub-command, its usage line, description and every argument
(flags, metavar, choices, default, help), formatted at a fixed width so the page does not
depend on the terminal it was made in.

    python -m fedhop.deploy.cli.clidoc --write docs/cli.md   # regenerate the committed page
    python -m fedhop.deploy.cli.clidoc --check docs/cli.md   # exit 1 when the page is out of date
"""
from __future__ import annotations

import argparse
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from fedhop.deploy.cli.pagegen import page_main

REGENERATE = "python -m fedhop.deploy.cli.clidoc --write docs/cli.md"
WIDTH = 100   # usage lines are wrapped at this width whatever the terminal


class _Parser(Exception):
    """Raised in place of parsing: carries the parser a command built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@contextmanager
def _capturing() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def hand_back(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parser(self)

    argparse.ArgumentParser.parse_args = hand_back  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def parser_of(call: Callable[[], Any]) -> argparse.ArgumentParser:
    """The parser `call` builds: the first one it asks to parse a command line."""
    with _capturing():
        try:
            call()
        except _Parser as got:
            return got.parser
    raise RuntimeError(f"{call} returned without parsing a command line")


def _cli(*argv: str) -> Callable[[], Any]:
    def call() -> Any:
        from fedhop.deploy.cli.cli import main
        return main(list(argv))
    return call


def _bench_large() -> Any:
    # `fedhop bench large` re-executes Python with tuned malloc settings before it reaches its
    # parser (deploy/launch/malloc.py); its own main is what that new process runs.
    from fedhop.deploy.bench.bench_large import main
    return main([])


# Commands whose arguments are a further command line of their own (not argparse sub-parsers):
# where each one's parser is, listed after its parent command.
NESTED: dict[str, list[tuple[str, Callable[[], Any]]]] = {
    "bench": [("large", _bench_large), ("flower", _cli("bench", "flower"))],
    "data": [("fetch", _cli("data", "fetch"))],
}


# ----------------------------------------------------------------------------- the parsers
@dataclass(frozen=True)
class Command:
    """One command of the reference: its name as typed and its parser."""

    name: str                        # "fedhop run", "fedhop data fetch", "fedhop examples copy"
    parser: argparse.ArgumentParser
    help: str                        # the one line its parent's command list shows


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return out


def _expand(parent: str, parser: argparse.ArgumentParser, help: str) -> list[Command]:
    """`parser` as the command `parent`, then its argparse sub-commands, depth first."""
    out = [Command(parent, parser, help)]
    for name, sub, sub_help in _subparsers(parser):
        out += _expand(f"{parent} {name}", sub, sub_help)
    return out


def commands() -> list[Command]:
    """Every command of `fedhop`, in the order `fedhop --help` lists them."""
    top = parser_of(_cli())
    out = [Command("fedhop", top, top.description or "")]
    for name, stub, help in _subparsers(top):
        # `run` is parsed by the top-level parser; every other command by its own module's parser
        parser = stub if name == "run" else parser_of(_cli(name))
        out += _expand(f"fedhop {name}", parser, help)
        for nested, call in NESTED.get(name, []):
            out += _expand(f"fedhop {name} {nested}", parser_of(call), "")
    return out


# ----------------------------------------------------------------------------- markdown
def anchor(title: str) -> str:
    """The id MkDocs' table of contents gives a heading (its default slugify)."""
    slug = re.sub(r"[^\w\s-]", "", title.strip().lower())
    return re.sub(r"[-\s]+", "-", slug)


def _cell(text: str) -> str:
    """One table cell or paragraph of plain help text: on one line, with what Markdown would read as
    markup (table bars, emphasis, HTML tags) escaped outside `code` spans."""
    parts = re.split(r"(`[^`]*`)", re.sub(r"\s+", " ", text).strip())
    for i in range(0, len(parts), 2):   # the even parts are outside code spans
        parts[i] = (parts[i].replace("\\", "\\\\").replace("*", "\\*").replace("_", "\\_")
                    .replace("<", "&lt;").replace(">", "&gt;"))
    return "".join(parts).replace("|", "\\|")


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip("\n")


def _description(parser: argparse.ArgumentParser) -> list[str]:
    text = (parser.description or "").strip("\n")
    if not text:
        return []
    if parser.formatter_class is argparse.RawDescriptionHelpFormatter:   # laid out by hand: kept as written
        import textwrap
        return ["```text", textwrap.dedent(text).strip("\n"), "```", ""]
    return [_cell(text), ""]


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    formatter = parser._get_formatter()
    return _cell(formatter._expand_help(action))


def _names(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    if not action.option_strings:
        return f"`{formatter._metavar_formatter(action, action.dest)(1)[0]}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    args = formatter._format_args(action, action.dest.upper())
    return ", ".join(f"`{o} {args}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS or action.nargs == 0 or value in ([], ""):
        return ""   # nothing to show: unset, a flag, or an empty string or list
    return f"`{value}`"


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        required = " (required)" if action.required and action.option_strings else ""
        rows.append(f"| {_names(parser, action)}{required} | {_default(action)} | {_help(parser, action)} |")
    if not rows:
        return []
    return ["| argument | default | description |", "|---|---|---|", *rows, ""]


def _command_table(items: list[Command]) -> list[str]:
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`{c.name}`](#{anchor(c.name)}) | {_cell(c.help)} |" for c in items]
    return lines + [""]


_INTRO = """\
# Command-line reference

<!-- Generated from the argparse parsers by deploy/cli/clidoc.py; do not edit by hand.
     Regenerate: {regenerate} -->

Every command, sub-command and flag of `fedhop`, as its parser defines it: the usage line, what
the command does, and each argument with its choices, default and description.  `fedhop COMMAND
--help` prints the same from the installed version.  What the commands do together is in the
tutorials ([your first run](tutorials/first-run.md), [comparing runs](tutorials/compare-runs.md))
and the how-to guides; every config key `--set` can override is in the
[configuration reference](config.md).

"""


def markdown() -> str:
    """docs/cli.md."""
    every = commands()
    top, rest = every[0], every[1:]
    lines = [_INTRO.format(regenerate=REGENERATE).rstrip("\n"), "",
             "```text", _usage(top.parser), "```", ""]
    lines += ["`fedhop --version` prints the installed version.", ""]
    lines += _command_table([c for c in rest if c.name.count(" ") == 1])
    for command in rest:
        depth = command.name.count(" ")   # fedhop run: 1, fedhop data fetch: 2
        lines += [f"{'#' * min(depth + 1, 4)} {command.name}", ""]
        if command.help:
            lines += [_cell(command.help[:1].upper() + command.help[1:]) + ".", ""]
        lines += ["```text", _usage(command.parser), "```", ""]
        lines += _description(command.parser)
        lines += _arguments(command.parser)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m fedhop.deploy.cli.clidoc [--write PATH | --check PATH]`: docs/cli.md."""
    return page_main("python -m fedhop.deploy.cli.clidoc", "the parsers", markdown, REGENERATE, argv)


if __name__ == "__main__":
    sys.exit(main())
