"""The command line of a generated docs page (`python -m fedhop.deploy.cli.clidoc`, docs/cli.md;
`python -m fedhop.deploy.cli.configref`, docs/config.md): print it, `--write PATH`, or `--check PATH`.
One implementation, so that both pages are written and checked alike: CI and a contributor
regenerate either page with the same flags and read the same one-line answers."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from fedhop.common.util.cliparser import ArgumentParser


def page_main(prog: str, source: str, page: Callable[[], str], regenerate: str,
              argv: list[str] | None = None) -> int:
    """`prog [--write PATH | --check PATH]`: the page `page()` makes from `source` (e.g. "the
    schema") on stdout, written to PATH, or compared with PATH: exit 1 when it differs (saying
    how to regenerate it), 2 when PATH cannot be read (one line naming it)."""
    ap = ArgumentParser(prog=prog, description=f"the markdown reference, generated from {source}")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="write the markdown reference to PATH")
    group.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the generated reference")
    args = ap.parse_args(argv)
    text = page()
    if args.write:
        Path(args.write).write_text(text)
        return 0
    if args.check:
        try:
            same = Path(args.check).read_text() == text
        except OSError as exc:
            print(f"cannot read {args.check}: {exc.strerror}", file=sys.stderr)
            return 2
        if not same:
            print(f"{args.check} differs from the page generated from {source}; regenerate it: {regenerate}",
                  file=sys.stderr)
        return 0 if same else 1
    sys.stdout.write(text)
    return 0
