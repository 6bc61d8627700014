"""Process titles an operator can read in `ps` and /proc/PID/cmdline.

Every role names itself once it knows who it is: `fedhop server <run>`, `fedhop edge edge-2`,
`fedhop client client-proc0 [0-24]`.  A child forked from the launcher (deploy/launch/forkstart.py)
would otherwise show the launcher's own `fedhop run ...` command line; an exec'd one would show
`python -m fedhop.client ...`.  setproctitle rewrites the process's argv area, which is what
/proc/PID/cmdline and `ps` read.
"""
from __future__ import annotations

import setproctitle

from fedhop.common.util.nodeids import id_spec


def prepare() -> None:
    """Let setproctitle find the argv area now.  It looks for it by walking from the C `environ`
    the first time it is used; a forked child that replaces its environment first
    (deploy/launch/forkstart.py) would leave it unable to, and every later title would be dropped."""
    setproctitle.getproctitle()


def role_title(role: str, name: str, clients: list[int] | None = None) -> str:
    """The title of one role process; `clients` (a client process's logical clients) in brackets."""
    title = f"fedhop {role} {name}"
    return f"{title} [{id_spec(clients)}]" if clients else title


def set_role_title(role: str, name: str, clients: list[int] | None = None) -> str:
    """Set and return this process's title (see `role_title`)."""
    title = role_title(role, name, clients)
    setproctitle.setproctitle(title)
    return title
