"""run.engine's values, and the one line every command that starts role processes prints for a
config whose engine keeps every role inside `fedhop run` (deploy/launch/inprocess.py).

Kept apart from deploy/launch/inprocess.py so that the commands checking it (fedhop launch, slurm, k8s,
netsim) do not import the roles and torch to do so.
"""
from __future__ import annotations

import os
from typing import Any

PROCESSES = "processes"   # every role its own OS process (deploy/launch/launcher.py, and every deploy command)
INPROCESS = "inprocess"   # every role inside the `fedhop run` process (deploy/launch/inprocess.py)
#: the cores one in-process run may use where several share the machine (`fedhop sweep` sets it for
#: its runs: the machine's cores over its `parallel`); run.workers = "auto" forks that many workers
#: (deploy/launch/workers.py `run_cores`)
RUN_CORES_ENV = "FEDHOP_RUN_CORES"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one (what
    taskset, a container's cpuset or a Slurm allocation leave it), else every core."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):   # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def process_launch_problem(cfg: Any, command: str) -> str | None:
    """Why `command`, which starts separate role processes (on machines, in jobs, in
    containers), cannot run `cfg` (one line naming the key), or None."""
    if cfg.run.engine != INPROCESS:
        return None
    return (f"{command}: config key 'run.engine' = 'inprocess' runs every role inside one `fedhop run` process, and "
            f"{command} starts separate processes: set run.engine = \"processes\" (--set run.engine=processes)")
