"""The asynchronous topology: FedBuff (Nguyen et al., AISTATS 2022) and FedAsync (Xie, Koyejo and
Gupta, 2019) as one folder (docs/async.md).

Clients sit under the server as in the star topology (the star's process plan), but there are no
rounds of sampled clients: at most `concurrency` clients train at once, each on the model version
it was sent, and the server updates the model as their deltas arrive, in simulated-time order on
the virtual clock or in arrival order on real time (driver.py).  One "round" of the run
(run.rounds, the rounds table, evaluation every run.eval_every) is one server update: a FedBuff
buffer flush or a FedAsync arrival.  The rule itself (the staleness functions, the buffer, the
mixing step) is rule.py; the server's part is driver.py, which sends only the core `train` method
through the fabric, so this folder declares no protocol method and the clients run the configured
algorithm's client side unchanged.

With `topology.edges` > 0 the buffer lives at the edges: each dispatch is one edge call that
trains `buffer_size` of the edge's clients on the version it was sent, and the server applies
the edge's flush as one update (driver.py; the process plan is then the hierarchical one, an
edge per cluster of `topology.assignment`).

Not in this folder yet (refused at config load): the torch transport, checkpoints (in-flight
clients would be lost on resume), stragglers' work plans, deadlines and over-commitment
(concepts of synchronous rounds).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedhop.common.topologies.spec import TopologySpec

MODES = ("fedbuff", "fedasync")
STALENESS = ("constant", "polynomial", "hinge")
CLOCKS = ("virtual", "real")
ALGORITHMS = ("fedavg",)         # a client side whose reply is the model delta Delta = x_local - x_sent
TRANSPORTS = ("grpc", "inmemory")


@dataclass
class AsyncParams:
    """Asynchronous federated learning: FedBuff (buffered, `mode = "fedbuff"`) or FedAsync (each
    arrival mixed in, `mode = "fedasync"`); one run round is one server update (docs/async.md).

    `mode`: "fedbuff" (Nguyen et al. 2022) or "fedasync" (Xie et al. 2019)
    `concurrency`: clients training at once (0: clients.per_round's number); a finished client is replaced at once.
        Behind edges (topology.edges > 0): edge calls in flight, at most one per edge (0: every edge)
    `buffer_size`: FedBuff's K, the deltas buffered before the server applies their mean.
        Behind edges: the clients each edge call trains, whose mean the edge sends up as one update
    `server_lr`: FedBuff's server step size eta_g
    `mixing`: FedAsync's alpha in x <- (1 - a_t) x + a_t x_new, a_t = alpha * s(t - tau)
    `staleness`: the staleness weight s: "constant" (1), "polynomial" ((t - tau + 1)^-a) or "hinge"
    `staleness_a`: a of the polynomial and hinge functions (FedBuff's paper: polynomial, a = 0.5)
    `staleness_b`: b of the hinge function: updates at most b versions stale keep weight 1
    `clock`: the order updates are applied in: "virtual" (simulated finish time of the [clients] device profiles, decided by the seed) or "real" (arrival)
    """

    mode: str = field(default="fedbuff", metadata={"choices": MODES})
    concurrency: int = field(default=0, metadata={"min": 0})
    buffer_size: int = field(default=10, metadata={"min": 1})
    server_lr: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    mixing: float = field(default=0.5, metadata={"min_exclusive": 0.0, "max": 1.0})
    staleness: str = field(default="constant", metadata={"choices": STALENESS})
    staleness_a: float = field(default=0.5, metadata={"min": 0.0})
    staleness_b: int = field(default=4, metadata={"min": 0})
    clock: str = field(default="virtual", metadata={"choices": CLOCKS})


def concurrency_of(cfg: Any, params: AsyncParams) -> int:
    """The number of calls in flight: `concurrency`, or where it is 0 clients.per_round's number
    (behind edges: every edge)."""
    if params.concurrency:
        return params.concurrency
    if cfg.topology.edges:
        return int(cfg.topology.edges)
    from fedhop.common.config.schema import resolve_clients_per_round  # local: only where it is 0
    return resolve_clients_per_round(cfg)


def clients_key(cfg: Any, key: str, default: float) -> float:
    """A [clients] device key (common/engine's device profiles): from the validated params, or the raw options."""
    params = getattr(cfg.clients, "params", None)
    if params is not None and hasattr(params, key):
        return float(getattr(params, key))
    return float(getattr(cfg.clients, "options", {}).get(key, default))


def check(cfg: Any) -> None:
    """What the asynchronous rule cannot run, as ValueError("key: why") (the loader names the key)."""
    from fedhop.common.topologies.graphs import topology_params
    params: AsyncParams = topology_params(cfg)
    if cfg.algorithm.name not in ALGORITHMS:
        raise ValueError(f"algorithm.name: got '{cfg.algorithm.name}', but the asynchronous topology applies each "
                         f"client's model delta by its own rule (allowed: {', '.join(ALGORITHMS)})")
    if float(cfg.algorithm.server_lr) != 1.0:
        raise ValueError(f"algorithm.server_lr: got {cfg.algorithm.server_lr}, but the asynchronous topology's server "
                         f"step is topology.server_lr (FedBuff) or topology.mixing (FedAsync); leave it at 1.0")
    if cfg.transport.kind not in TRANSPORTS:
        raise ValueError(f"transport.kind: got '{cfg.transport.kind}', but the asynchronous topology sends each "
                         f"client its own call (allowed: {', '.join(TRANSPORTS)})")
    if cfg.topology.edges:
        edge_checks(cfg, params)
    elif cfg.topology.assignment != "blocks":
        raise ValueError(f"topology.assignment: got {cfg.topology.assignment!r}, but without edges "
                         f"(topology.edges = 0) there are no clusters to assign clients to")
    inert = inert_key(params, bool(cfg.topology.edges))
    if inert:
        raise ValueError(inert)
    if cfg.run.checkpoint_every:
        raise ValueError(f"run.checkpoint_every: got {cfg.run.checkpoint_every}, but the asynchronous topology does "
                         f"not keep its clients in flight across a resume (allowed: 0)")
    if float(cfg.clients.straggler_fraction) > 0:
        raise ValueError(f"clients.straggler_fraction: got {cfg.clients.straggler_fraction}, but straggler work plans "
                         f"belong to synchronous rounds; give slow clients a clients.slowdown instead (allowed: 0)")
    deadline, overcommit = clients_key(cfg, "deadline_seconds", 0.0), clients_key(cfg, "overcommit", 1.0)
    if deadline > 0:
        raise ValueError(f"clients.deadline_seconds: got {deadline:g}, but the asynchronous topology has no round to "
                         f"cut (allowed: 0)")
    if overcommit > 1:
        raise ValueError(f"clients.overcommit: got {overcommit:g}, but the asynchronous topology replaces each "
                         f"finished client instead (allowed: 1)")
    n = concurrency_of(cfg, params)
    if not cfg.topology.edges and n > cfg.clients.count:
        raise ValueError(f"topology.concurrency: got {n}, more clients in flight than clients.count = "
                         f"{cfg.clients.count}")


def inert_key(params: AsyncParams, edges: bool) -> str | None:
    """A key given a value other than its default that this mode and staleness function never read,
    as "key: why" (a user who sets it believes it changes the run)."""
    defaults = AsyncParams()
    unread = {"fedasync": ("server_lr",) + (() if edges else ("buffer_size",)), "fedbuff": ("mixing",)}[params.mode]
    unread += {"constant": ("staleness_a", "staleness_b"), "polynomial": ("staleness_b",), "hinge": ()}[params.staleness]
    for key in unread:
        if getattr(params, key) != getattr(defaults, key):
            reader = {"server_lr": "mode = \"fedbuff\"", "mixing": "mode = \"fedasync\"",
                      "buffer_size": "mode = \"fedbuff\" (or edges)", "staleness_a": "staleness = \"polynomial\" or \"hinge\"",
                      "staleness_b": "staleness = \"hinge\""}[key]
            return (f"topology.{key}: got {getattr(params, key)}, but mode = \"{params.mode}\" with staleness = "
                    f"\"{params.staleness}\" does not use it (it applies with {reader}); remove the key")
    return None


def edge_checks(cfg: Any, params: AsyncParams) -> None:
    """Behind edges: an edge call per edge at a time, `buffer_size` clients in every cluster."""
    from fedhop.common.topologies.graphs import cluster_assignment
    edges = cfg.topology.edges
    if edges > cfg.clients.count:
        raise ValueError(f"topology.edges: got {edges}, more edges than clients.count = {cfg.clients.count}")
    if params.concurrency > edges:
        raise ValueError(f"topology.concurrency: got {params.concurrency}, but behind edges it counts edge calls in "
                         f"flight, one per edge (at most topology.edges = {edges}; 0: every edge)")
    smallest = min(len(c) for c in cluster_assignment(cfg))
    if params.buffer_size > smallest:
        raise ValueError(f"topology.buffer_size: got {params.buffer_size}, but behind edges each edge call trains "
                         f"buffer_size of its clients and the smallest cluster has {smallest}")


def process_plan(cfg: Any, placement: Any = None) -> Any:
    """The star's processes, or behind edges the hierarchical ones (an edge per cluster)."""
    from fedhop.common.topologies.plan import edge_plan, star_plan
    return (edge_plan if cfg.topology.edges else star_plan)(cfg, placement)


SPEC = TopologySpec(
    name="asynchronous",
    params=AsyncParams,
    check=check,
    driver="fedhop.topologies.asynchronous.driver:AsyncDriver",
    plan="fedhop.topologies.asynchronous:process_plan",
    edges_optional=True,
    ef21_uploads=False,   # results are folded as they come, with no per-sender EF21 estimate kept
)
