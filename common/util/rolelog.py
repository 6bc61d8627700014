"""The role processes' log line: its format (`line_format`, set by common/transport/startup.py
`announce`) and the reading of it back (`refusal_line`, `refusal_of`): what a launcher shows when a
role it started refused to start (`RoleRefused`), instead of the log's tail.  Imports nothing
heavy (the launchers read it before torch loads)."""
from __future__ import annotations

import re
from pathlib import Path


def line_format(node: str) -> str:
    """`logging`'s format of a role's lines: time, node, level, message."""
    return f"%(asctime)s {node} %(levelname)s %(message)s"


# line_format's lines: "2026-12-01 13:33:57,476 server ERROR message"
_LINE = re.compile(r"^\S+ \S+ (?P<node>\S+) (?P<level>[A-Z]+) (?P<message>.*)$")


def refusal_line(log: Path, node: str) -> str | None:
    """The last ERROR line `node` wrote to `log`, without its time, node and level: what the role
    said when it refused to start (exit status 2); None when it said nothing."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [m["message"] for m in map(_LINE.match, lines) if m and m["node"] == node and m["level"] == "ERROR"]
    return found[-1].removeprefix("refusing to start: ") if found else None


def refusal_of(status: int | None, log: Path, node: str) -> str | None:
    """What `node` said when it refused to start: its refusal line when it exited with status 2
    (a refused config, data set or credential) and said why; None otherwise."""
    return refusal_line(log, node) if status == 2 else None


class RoleRefused(RuntimeError):
    """A role process refused its run as it started (exit status 2, its own line in its log): the
    message carries that line, and a launcher meeting it exits 2, as `fedhop run` does for a
    refused config."""
