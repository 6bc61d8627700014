"""Run a whole experiment in one process over the in-memory transport (unit tests' entry point).

`run_inmemory` is the in-process engine (deploy/launch/inprocess.py, run.engine = "inprocess") called
from Python: the server and the client processes are the same classes a real run uses; only the
endpoint differs, so the final model and the ledger's byte counts equal those of a gRPC run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from fedhop.common.config import Config
from fedhop.deploy.launch.inprocess import build
from fedhop.server.coordinator import Coordinator
from fedhop.transports.inmemory.endpoint import InMemoryNetwork


def run_inmemory(cfg: Config, run_dir: str | Path,
                 before_run: Callable[[InMemoryNetwork, list, Coordinator], None] | None = None
                 ) -> tuple[dict, Coordinator]:
    """Run `cfg` to completion in this process; return the summary and the coordinator.
    `before_run(network, processes, coordinator)` runs once every process has registered
    (fault tests: stop an edge's endpoint to make it unreachable)."""
    engine = build(cfg, run_dir)
    if before_run is not None:
        before_run(engine.network, [role.process for role in engine.roles], engine.coordinator)
    return engine.run(register_timeout=10.0), engine.coordinator
