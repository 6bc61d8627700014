"""The drivers' `DriverContext` (server/driver.py), built over the Coordinator.

Each group is a view that reads the Coordinator when it is used (a resume replaces the server's
state and sets the restored topology after the Coordinator was made), so a driver never holds a
stale copy.  The context also answers the flat names a driver used before the groups (`ctx.cfg`,
`ctx.client_home`, `ctx.complete_round`, ...) with the Coordinator's member and a
DeprecationWarning naming the new path (`LEGACY`), so a plug-in written against them keeps
working for one release (docs/plugins.md).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pathlib import Path

    from fedhop.common.algorithms.base import Algorithm, ServerState
    from fedhop.common.config import Config
    from fedhop.common.engine.vclock import RoundClock
    from fedhop.common.processors.validation import ReplyLimits
    from fedhop.common.records.runstore import RunStore
    from fedhop.common.tasks.base import Task
    from fedhop.common.transport.fabric import Fabric
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload
    from fedhop.server.coordinator import Coordinator
    from fedhop.server.driver import ChildNode, RoundResult

# the flat names of the context before it was grouped -> where each is now
LEGACY = {
    "cfg": "run.cfg", "run_id": "run.run_id", "run_dir": "run.run_dir", "task": "run.task",
    "algorithm": "run.algorithm",
    "state": "model.state", "client_message": "model.client_message", "group_message": "model.group_message",
    "limiter": "model.reply_limits",
    "children": "nodes.children", "client_home": "nodes.client_home", "unavailable": "nodes.unavailable",
    "sample": "nodes.sample",
    "store": "records.store", "ledger": "records.ledger", "summary_hooks": "records.summary_hooks",
    "restored_topology": "records.restored_topology", "round_metrics": "records.round_metrics",
    "record_round": "records.record_round",
    # the engine of sampled rounds (server/sampled.py SampledRounds), no longer in the context
    "streams": "rounds.streams of server/sampled.py's SampledRoundDriver",
    "note_failures": "rounds.note_failures of server/sampled.py's SampledRoundDriver",
    "is_short": "rounds.is_short of server/sampled.py's SampledRoundDriver",
    "short_round": "rounds.short_round of server/sampled.py's SampledRoundDriver",
    "complete_round": "rounds.complete_round of server/sampled.py's SampledRoundDriver",
}


class _View:
    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord


class RunView(_View):
    @property
    def cfg(self) -> Config:
        return self._coord.cfg

    @property
    def run_id(self) -> str:
        return self._coord.run_id

    @property
    def run_dir(self) -> Path:
        return self._coord.run_dir

    @property
    def task(self) -> Task:
        return self._coord.task

    @property
    def algorithm(self) -> Algorithm:
        return self._coord.algorithm


class ModelView(_View):
    @property
    def state(self) -> ServerState:
        return self._coord.state

    def client_message(self, message: Payload, round: int, cid: int) -> Payload:
        return self._coord.client_message(message, round, cid)

    def group_message(self, message: Payload, round: int, cids: list[int]) -> Payload:
        return self._coord.group_message(message, round, cids)

    def reply_limits(self, cids: list[int]) -> ReplyLimits:
        return self._coord.limiter.limits(cids)


class NodesView(_View):
    @property
    def children(self) -> dict[str, ChildNode]:
        return self._coord.children

    @property
    def client_home(self) -> dict[int, ChildNode]:
        return self._coord.client_home

    @property
    def unavailable(self) -> dict[str, set[int]]:
        return self._coord.unavailable

    def sample(self, round: int, attempt: int = 0) -> list[int]:
        return self._coord.sample(round, attempt)


class RecordsView(_View):
    @property
    def store(self) -> RunStore:
        return self._coord.store

    @property
    def ledger(self) -> Ledger:
        return self._coord.ledger

    @property
    def summary_hooks(self) -> list[Callable[[], dict]]:
        return self._coord.summary_hooks

    @property
    def restored_topology(self) -> dict | None:
        return self._coord.restored_topology

    def round_metrics(self, round: int, aggregate: Payload) -> dict[str, float]:
        return self._coord.round_metrics(round, aggregate)

    def record_round(self, result: RoundResult) -> None:
        self._coord.record_round(result)


class CoordinatorContext:
    """The Coordinator's `DriverContext` (module docstring)."""

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord
        self.run, self.model = RunView(coord), ModelView(coord)
        self.nodes, self.records = NodesView(coord), RecordsView(coord)

    @property
    def fabric(self) -> Fabric:
        return self._coord.fabric

    @property
    def clock(self) -> RoundClock:
        return self._coord.clock

    def __getattr__(self, name: str) -> Any:
        """A flat name of the context before it was grouped: the Coordinator's member, with a
        DeprecationWarning naming where it is now (`LEGACY`)."""
        if name not in LEGACY:
            raise AttributeError(f"the driver context has no '{name}' (server/driver.py DriverContext: run, model, "
                                 f"nodes, fabric, records, clock)")
        warnings.warn(f"ctx.{name} is deprecated and goes in the next release; use ctx.{LEGACY[name]} "
                      f"(server/driver.py DriverContext)", DeprecationWarning, stacklevel=2)
        return getattr(self._coord, name)
