"""Topology drivers: what a round is, per `topology.kind` (shared/DESIGN.md section 2).

The Coordinator (server/coordinator.py) owns registration, the round loop and finalising; a
driver owns one topology's round protocol, its checkpoint state and resume, and the part of
summary.json that describes its walk.  Which driver runs a kind is the `driver` of the kind's
spec (common/topologies/, `driver_class`).

A driver sees the run only through `DriverContext`, the public face of the Coordinator, and
sends only through the context's fabric (common/transport/fabric.py).  A user's own topology
needs no edit of fedhop: a `TopologySpec`, or the short form, a subclass of `TopologyDriver` in
the user's package whose class attributes `Params` and `process_plan` stand for the spec's
`params` and `plan`, named by `topology.kind = "pkg.module:Name"` or by an entry point of group
`fedhop.topologies` (common/topologies `load_topology`; docs/architecture.md, "How to add a
topology").
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from fedhop.common.topologies import spec_for
from fedhop.common.util.nodeids import client_node  # noqa: F401  # re-exported: the drivers' name for a client

if TYPE_CHECKING:
    from pathlib import Path

    from fedhop.common.algorithms.base import Algorithm, ServerState
    from fedhop.common.config import Config
    from fedhop.common.engine.vclock import RoundClock
    from fedhop.common.processors.validation import ReplyLimiter
    from fedhop.common.records.runstore import RunStore
    from fedhop.common.tasks.base import Task
    from fedhop.common.transport.fabric import Fabric
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload


class RunFailed(RuntimeError):
    """The run cannot go on (too few results, registration timed out, ...)."""


@dataclass
class ChildNode:
    """A registered child process (client process or edge)."""

    node_id: str
    role: str
    address: str
    clients: list[int]


@dataclass
class RoundResult:
    round: int
    sampled: list[int]
    participants: list[int]
    failures: dict[int, str]
    metrics: dict[str, float]
    wall_seconds: float
    sim_seconds: float | None = None   # virtual-clock duration (common/engine/vclock.py); None where not simulated


class DriverContext(Protocol):
    """What a driver may use of the run (the Coordinator implements it)."""

    cfg: Config
    task: Task
    algorithm: Algorithm
    state: ServerState
    store: RunStore
    ledger: Ledger
    fabric: Fabric
    clock: RoundClock
    run_id: str
    children: dict[str, ChildNode]
    client_home: dict[int, ChildNode]
    restored_topology: dict | None
    summary_hooks: list[Callable[[], dict]]
    limiter: ReplyLimiter          # what a reply may claim for its clients (common/processors/validation.py)

    unavailable: dict[str, set[int]]   # clients an edge reported dead, by edge node id
    run_dir: Path                      # where a streaming fold spills replies ahead of their turn

    def streams(self, per_client: bool = True) -> bool: ...   # replies folded as they arrive (common/processors/streaming.py)

    def sample(self, round: int, attempt: int = 0) -> list[int]: ...
    def note_failures(self, round: int, failures: dict[int, str], per_client: bool) -> None: ...
    def is_short(self, sampled: list[int], results: dict, failures: dict[int, str]) -> bool: ...
    def short_round(self, round: int, attempt: int, sampled: list[int], failures: dict[int, str]) -> str: ...
    def group_message(self, message: Payload, round: int, cids: list[int]) -> Payload: ...
    def client_message(self, message: Payload, round: int, cid: int) -> Payload: ...
    def complete_round(self, round: int, sampled: list[int], results: dict[int, Payload], failures: dict[int, str],
                       message: Payload, started: float, dispatched: float, arrivals: dict[int, float],
                       per_client: bool = True) -> RoundResult | None: ...
    def round_metrics(self, round: int, aggregate: Payload) -> dict[str, float]: ...
    def record_round(self, result: RoundResult) -> None: ...


class TopologyDriver(ABC):
    """One topology's rounds.  `start` runs once after every child registered (and after a
    resume restored the server's state); `run_round` runs each round and records it through
    `ctx.record_round`; `checkpoint_state`/`restore` carry what the topology must keep across a
    resume beyond the model; `summary` adds the topology's keys to summary.json."""

    kind: ClassVar[str] = ""
    checkpoint_needs_state: ClassVar[bool] = False   # a resume needs `checkpoint_state` (the model lives elsewhere)
    # a plug-in's own [topology] keys (a dataclass; None: none) and its processes (None: common/topologies/plan.py
    # `star_plan`); a function (cfg, placement) -> ProcessPlan, e.g. `process_plan = staticmethod(edge_plan)`
    Params: ClassVar[type | None] = None
    process_plan: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, ctx: DriverContext) -> None:
        self.ctx = ctx

    def start(self) -> None:
        """After registration: set up what rounds need (a torch.distributed world, ...)."""

    @abstractmethod
    def run_round(self, round: int) -> RoundResult | None:
        """Run round `round` and record it (`ctx.record_round`); None: the round was skipped."""

    def checkpoint_state(self) -> dict | None:
        """What a checkpoint must keep of the topology (None: nothing beyond the model)."""
        return None

    def restore(self, state: dict) -> None:
        raise RunFailed(f"topology.kind = '{self.kind}' keeps no state in checkpoints, got {state}")

    def checkpoint_due(self, round: int) -> bool:
        """Whether a checkpoint follows `round` (server/resilience.py saves it)."""
        every = self.ctx.cfg.run.checkpoint_every
        return bool(every) and round % every == 0 and round != self.ctx.cfg.run.rounds

    def summary(self) -> dict:
        return {}


def driver_kind(kind: str) -> Callable[[type[TopologyDriver]], type[TopologyDriver]]:
    """Class decorator: set a built-in driver class's kind (`cls.kind`, which its messages name).
    It only names the class: which class runs a kind is that kind's spec's `driver`
    (common/topologies/, read by `driver_class` below)."""
    def add(cls: type[TopologyDriver]) -> type[TopologyDriver]:
        cls.kind = kind
        return cls
    return add


def driver_class(kind: str) -> type[TopologyDriver]:
    """The driver class of topology `kind`: its spec's `driver` (common/topologies `spec_for`;
    a plug-in's spec was loaded already by the config loader)."""
    try:
        cls: type[TopologyDriver] = spec_for(kind).driver_class()
    except (KeyError, ValueError) as exc:
        raise RunFailed(f"topology.kind = '{kind}' has no driver ({exc.args[0] if exc.args else exc})") from None
    if "kind" not in vars(cls):   # error messages name the kind as the config wrote it
        cls.kind = kind
    return cls


def make_driver(ctx: DriverContext) -> TopologyDriver:
    return driver_class(ctx.cfg.topology.kind)(ctx)
