"""`TopologySpec`: everything fedhop knows about one topology kind, in one object.

A topology is a `[topology]` config section whose `kind` names a spec (common/topologies/__init__.py
`spec_for`).  The spec declares the kind's own config keys (`params`), what the config loader
refuses for it (`check`), which processes a run starts (`plan`), and the code each role runs for
it: the server's driver, what an edge adds beside its aggregator, the client handlers.  Role code
is named by reference, an import path "package.module:attribute" resolved when a role asks for it
(`resolve`), so common/ imports no role package; a plug-in's spec may hold the objects themselves.

A topology's own protocol methods (name, allowed callers, ledger link, request size) are in its
spec's `methods`: making the spec declares them into the one method table (common/wire/methods.py
`METHODS`) that authorization, the ledger's link rule and the live page read, so a plug-in's
methods are served and refused exactly like the built-ins'.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fedhop.common.wire.methods import Method, declare

Ref = Any   # an import path "package.module:attribute", or the object itself (plug-ins)


def resolve(ref: Ref) -> Any:
    """The object an import-path string names (the object itself if `ref` is not a string)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class TopologySpec:
    """One topology kind.

    `params`: the dataclass of the kind's own [topology] keys (None: none).  `check(cfg)`: raises
    ValueError("key: why") for what the kind refuses, after the common checks (the loader turns
    it into "config key 'key': why").  `plan`: `(cfg, placement) -> ProcessPlan` (common/topologies/plan.py).
    `driver`: the server's `TopologyDriver` subclass.  `edge_role`: a class made as
    `edge_role(aggregator)` in each edge process beside its aggregator (None: the aggregator
    alone).  `client_handlers`: functions `(host) -> {method: handler}` whose methods a client
    process serves beside train, state and ping (client/host.py).  `methods`: the kind's own
    protocol methods (common/wire/methods.py `Method`), declared into the method table when the
    spec is made; a name another owner declared with other callers is refused (`MethodClash`,
    naming both owners).  Its drivers and handlers use the objects (or `Method.<NAME>` once the spec is made).

    Data the common code reads instead of branching on the kind: `edges`: the run has edge
    processes (topology.edges must be 1..clients.count); `edges_optional`: the kind runs with or
    without edge processes as topology.edges says (asynchronous); a kind with neither refuses a
    topology.edges or topology.assignment of its own; `robust`: how a robust
    security.aggregation groups updates ("round": a round's sampled clients, "edge": each
    edge's clients; None: refused); `engine_rounds`: the in-process RoundEngine can play its
    rounds (common/engine/rounds.py); `sequential_algorithms`: it runs algorithms whose one model walks
    the edges (`SequentialAlgorithm`); `edge_steps_key`: the kind's [topology] key that asks for
    more than one edge aggregation per server round (the loader refuses a value above 1 for an
    algorithm with no edge step, `Algorithm.edge_iterations`); `peer_link`/`peer_note`: the link between peers the
    live page draws ("client-client", "edge-edge"; None: none); `coded_uploads`: its clients'
    results are train replies (and its edges' edge_round partials), which `[compression] up`
    codes (False: it moves models by its own methods, and a compressor is refused); `ef21_uploads`:
    the parent that decodes them keeps each sender's EF21 estimate (False: `compression.error_feedback
    = "ef21"` is refused, its uploads would reach a receiver that keeps no copies);
    `coded_broadcasts`: its round's broadcast reaches the clients in train calls (and edges in
    edge_round calls), which `[compression] down` codes against the model each receiving process
    holds (common/processors/compressors/downlink.py; False: `down` is refused).  `listed`: where
    the kind stands in lists of kinds (messages, the reference): lower first, then by name.
    """

    name: str
    driver: Ref
    plan: Ref = "fedhop.common.topologies.plan:star_plan"
    params: type | None = None
    check: Callable[[Any], None] | None = None
    edge_role: Ref | None = None
    client_handlers: tuple[Ref, ...] = ()
    edges: bool = False
    edges_optional: bool = False
    robust: Literal["round", "edge"] | None = None
    engine_rounds: bool = False
    sequential_algorithms: bool = False
    edge_steps_key: str | None = None
    peer_link: str | None = None
    peer_note: str = ""
    methods: tuple[Method, ...] = ()
    coded_uploads: bool = True
    ef21_uploads: bool = True
    coded_broadcasts: bool = False
    listed: int = 100

    def __post_init__(self) -> None:
        on_class = tuple(getattr(self.driver, "methods", ())) if isinstance(self.driver, type) else ()
        if not self.methods and on_class:
            # a plug-in given as a driver class (common/topologies `load_topology`) declares them on the class
            object.__setattr__(self, "methods", on_class)
        declare(self.methods, f"topology '{self.name}'")

    def driver_class(self) -> type:
        return resolve(self.driver)

    def plan_fn(self) -> Callable[..., Any]:
        return resolve(self.plan)

    def edge_role_class(self) -> type | None:
        return None if self.edge_role is None else resolve(self.edge_role)

    def handler_fns(self) -> list[Callable[[Any], dict]]:
        return [resolve(h) for h in self.client_handlers]
