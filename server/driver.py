"""Topology drivers: what a round is, per `topology.kind` (shared/DESIGN.md section 2).

The Coordinator (server/coordinator.py) owns registration, the round loop and finalising; a
driver owns one topology's round protocol, its checkpoint state and resume, and the part of
summary.json that describes its walk.  Which driver runs a kind is the `driver` of the kind's
spec (common/topologies/, `driver_class`).

A driver sees the run only through `DriverContext`, six members grouped by job (`run`,
`model`, `nodes`, `fabric`, `records`, `clock`) that the server builds over the Coordinator
(server/context.py), and sends only through the context's fabric (common/transport/fabric.py).
A user's own topology needs no edit of fedhop: a `TopologySpec`, or the short form, a subclass
of `TopologyDriver` in the user's package whose class attributes `Params` and `process_plan`
stand for the spec's `params` and `plan`, named by `topology.kind = "pkg.module:Name"` or by an
entry point of group `fedhop.topologies` (common/topologies `load_topology`;
docs/architecture.md, "How to add a topology").
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
    from fedhop.common.processors.validation import ReplyLimits
    from fedhop.common.records.runstore import RunStore
    from fedhop.common.tasks.base import Task
    from fedhop.common.transport.fabric import Fabric
    from fedhop.common.wire.ledger import Ledger
    from fedhop.common.wire.message import Payload
    from fedhop.server.sampled import SampledRounds


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


class RunFacts(Protocol):
    """`ctx.run`: what the run is (read only)."""

    @property
    def cfg(self) -> Config: ...
    @property
    def run_id(self) -> str: ...
    @property
    def run_dir(self) -> Path: ...        # the run's folder (run.db, a streaming fold's spill files)
    @property
    def task(self) -> Task: ...
    @property
    def algorithm(self) -> Algorithm: ...


class ServerModel(Protocol):
    """`ctx.model`: the server's state and the messages made from it.  A driver changes the
    model through the state (its `params`: `algorithm.server_update`, or a model it took back)."""

    @property
    def state(self) -> ServerState: ...
    def client_message(self, message: Payload, round: int, cid: int) -> Payload:
        """Client `cid`'s message this round: `message` or its own variant (Algorithm.client_message)."""
    def group_message(self, message: Payload, round: int, cids: list[int]) -> Payload:
        """One message for a group of clients (an edge's, a collective's): the largest of their variants."""
    def reply_limits(self, cids: list[int]) -> ReplyLimits:
        """What a reply speaking for clients `cids` may claim (its weight from their sample
        counts, its result count, its seconds: common/processors/validation.py `ReplyLimiter`)."""


class Nodes(Protocol):
    """`ctx.nodes`: the registered processes and which clients a round may take."""

    @property
    def children(self) -> dict[str, ChildNode]: ...        # by node id: client processes and edges
    @property
    def client_home(self) -> dict[int, ChildNode]: ...     # the process hosting each logical client
    @property
    def unavailable(self) -> dict[str, set[int]]: ...      # clients an edge reported dead, by edge node id
    def sample(self, round: int, attempt: int = 0) -> list[int]:
        """The round's clients (seeded), none on a process known dead; `attempt` > 0: a retry."""


class Records(Protocol):
    """`ctx.records`: what the run writes down, and what a resume gives back."""

    @property
    def store(self) -> RunStore: ...                       # run.db: events, rounds
    @property
    def ledger(self) -> Ledger: ...                        # the server's message records
    @property
    def summary_hooks(self) -> list[Callable[[], dict]]: ...   # sections of summary.json
    @property
    def restored_topology(self) -> dict | None: ...        # resume: the driver's `checkpoint_state`
    def round_metrics(self, round: int, aggregate: Payload) -> dict[str, float]:
        """The round's metrics: the aggregate's scalars and, in evaluation rounds, the model's evaluation."""
    def record_round(self, result: RoundResult) -> None:
        """Record a finished round: ledger records, its run.db row, checkpoints, progress."""


class DriverContext(Protocol):
    """What a topology's server part sees of the run, by job (docs/architecture.md, "The driver
    interface").  The server builds it (server/context.py); what only the sampled rounds of
    server/sampled.py use is the engine's `SampledRounds` (server/sampled.py), not part of it."""

    @property
    def run(self) -> RunFacts: ...
    @property
    def model(self) -> ServerModel: ...
    @property
    def nodes(self) -> Nodes: ...
    @property
    def fabric(self) -> Fabric: ...       # sending and collecting (common/transport/fabric.py)
    @property
    def records(self) -> Records: ...
    @property
    def clock(self) -> RoundClock: ...    # stragglers, device profiles, the virtual clock (common/engine/vclock.py)


class TopologyDriver(ABC):
    """One topology's rounds.  `start` runs once after every child registered (and after a
    resume restored the server's state); `run_round` runs each round and records it through
    `ctx.records.record_round`; `checkpoint_state`/`restore` carry what the topology must keep across a
    resume beyond the model; `summary` adds the topology's keys to summary.json."""

    kind: ClassVar[str] = ""
    checkpoint_needs_state: ClassVar[bool] = False   # a resume needs `checkpoint_state` (the model lives elsewhere)
    # a plug-in's own [topology] keys (a dataclass; None: none) and its processes (None: common/topologies/plan.py
    # `star_plan`); a function (cfg, placement) -> ProcessPlan, e.g. `process_plan = staticmethod(edge_plan)`
    Params: ClassVar[type | None] = None
    process_plan: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, ctx: DriverContext) -> None:
        self.ctx = ctx

    @classmethod
    def create(cls, ctx: DriverContext, rounds: SampledRounds) -> TopologyDriver:
        """How the server makes the driver: `cls(ctx)`.  `rounds` is the engine of sampled
        rounds, which only server/sampled.py's drivers take (`SampledRoundDriver.create`)."""
        return cls(ctx)

    def start(self) -> None:
        """After registration: set up what rounds need (a torch.distributed world, ...)."""

    @abstractmethod
    def run_round(self, round: int) -> RoundResult | None:
        """Run round `round` and record it (`ctx.records.record_round`); None: the round was skipped."""

    def checkpoint_state(self) -> dict | None:
        """What a checkpoint must keep of the topology (None: nothing beyond the model)."""
        return None

    def restore(self, state: dict) -> None:
        raise RunFailed(f"topology.kind = '{self.kind}' keeps no state in checkpoints, got {state}")

    def checkpoint_due(self, round: int) -> bool:
        """Whether a checkpoint follows `round` (server/resilience.py saves it)."""
        cfg = self.ctx.run.cfg
        every = cfg.run.checkpoint_every
        return bool(every) and round % every == 0 and round != cfg.run.rounds

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


def make_driver(ctx: DriverContext, rounds: SampledRounds) -> TopologyDriver:
    return driver_class(ctx.run.cfg.topology.kind).create(ctx, rounds)
