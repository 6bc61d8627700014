"""Which processes a config starts: the one process plan every launcher reads.

`plan_processes(cfg)` names each process of a run (node id, role kind, the node it registers
with, the logical clients it hosts).  `fedhop run` (deploy/launch/launcher.py), `fedhop launch`
(deploy/launch/hosts.py), compose's client replicas (deploy/launch/role.py), netsim's default hosts, the
in-memory cluster (deploy/launch/inmemory.py) and `fedhop certs --config` all start or name exactly
these processes, so they cannot disagree.

A topology declares its plan in its spec (common/topologies/, `TopologySpec.plan`);
`fn(cfg, placement)` returns a `ProcessPlan`.  The built-in ones:

- star, chain, relay, gossip: `star_plan`, every client process under the server, the clients split into
  `clients.processes` contiguous, near-equal blocks;
- hierarchical, sequential: `edge_plan`, one edge per cluster (`cluster_assignment`), each
  cluster split into max(1, clients.processes // edges) blocks under its edge.

`placement` lets the hosts launcher say which logical clients sit together on one machine and
how many client processes each parent gets there (`Placement(clients, per_parent)`); client
processes are numbered client-proc0, 1, ... group by group, parent by parent (server first,
then edges by index).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fedhop.common.topologies import replace_spec, spec_for
from fedhop.common.topologies.graphs import cluster_assignment
from fedhop.common.util.nodeids import SERVER, client_proc_node, edge_node


@dataclass(frozen=True)
class PlannedProcess:
    """One process of a run."""

    node_id: str                    # "server", "edge-<e>", "client-proc<k>"
    kind: str                       # "server" | "edge" | "client"
    parent: str | None              # node id of the process it registers with; None for the server
    clients: tuple[int, ...] = ()   # edge: its cluster; client process: the logical clients it hosts
    edge: int | None = None         # the edge index (an edge, or a client process under an edge)
    group: int = 0                  # client process: the index of the placement group it came from


@dataclass(frozen=True)
class ProcessPlan:
    processes: tuple[PlannedProcess, ...]

    @property
    def server(self) -> PlannedProcess:
        return self.processes[0]

    @property
    def edges(self) -> tuple[PlannedProcess, ...]:
        return tuple(p for p in self.processes if p.kind == "edge")

    @property
    def clients(self) -> tuple[PlannedProcess, ...]:
        """The client processes, in node-id order (client-proc0, 1, ...)."""
        return tuple(p for p in self.processes if p.kind == "client")

    @property
    def node_ids(self) -> list[str]:
        return [p.node_id for p in self.processes]

    def edge_of(self) -> dict[int, int]:
        """Logical client id -> the index of the edge that serves it (empty without edges)."""
        out: dict[int, int] = {}
        for e in self.edges:
            assert e.edge is not None   # an edge process always carries its index
            out.update((c, e.edge) for c in e.clients)
        return out


@dataclass(frozen=True)
class Placement:
    """Logical clients that sit together (one machine), split into `per_parent` client
    processes under each parent (server or edge) that serves some of them."""

    clients: tuple[int, ...]
    per_parent: int


PlanFn = Callable[[Any, Sequence[Placement] | None], ProcessPlan]


def register_plan(kind: str, fn: PlanFn) -> None:
    """Replace the process plan of topology `kind` (built in or a loaded plug-in) by `fn`: its spec
    is replaced by one with `plan = fn` (common/topologies `replace_spec`)."""
    if not kind or not isinstance(kind, str):
        raise ValueError(f"register_plan: topology kind must be a non-empty string, got {kind!r}")
    try:
        spec = spec_for(kind)
    except KeyError as exc:
        raise ValueError(f"register_plan: {exc.args[0] if exc.args else exc}") from None
    replace_spec(dataclasses.replace(spec, plan=fn))


def plan_processes(cfg: Any, placement: Sequence[Placement] | None = None) -> ProcessPlan:
    """The processes `cfg` starts (see the module docstring); `placement` as the hosts file gives it,
    or None for the launcher's own layout.  Checks that every logical client is hosted once."""
    too_many = plan_beyond_memory(cfg.clients.count)
    if too_many:
        from fedhop.common.config.schema import ConfigError  # local: the config package imports this layer
        raise ConfigError(too_many)
    try:
        fn = spec_for(cfg.topology.kind).plan_fn()
    except KeyError as exc:
        raise ValueError(f"topology.kind = '{cfg.topology.kind}' has no process plan "
                         f"({exc.args[0] if exc.args else exc})") from None
    plan = fn(cfg, placement)
    hosted = sorted(c for p in plan.clients for c in p.clients)
    if hosted != list(range(cfg.clients.count)):
        raise ValueError(f"the process plan of topology '{cfg.topology.kind}' hosts logical clients "
                         f"{hosted[:10]}{'...' if len(hosted) > 10 else ''}, not each of 0..{cfg.clients.count - 1} "
                         f"exactly once")
    return plan


#: bytes a logical client costs the process that builds a plan: its id in the plan's tuples, in the
#: blocks they are cut from and in the check that each is hosted once (Python ints, rounded up)
PLAN_BYTES_PER_CLIENT = 256


def memory_shortfall(count: int, bytes_each: int) -> tuple[int, int] | None:
    """(bytes needed, bytes available) when `count` things of `bytes_each` bytes would not fit in
    this machine's available memory, else None."""
    import psutil
    need, available = count * bytes_each, psutil.virtual_memory().available
    return None if need <= available else (need, available)


def plan_beyond_memory(count: int) -> str | None:
    """Why this process cannot plan `count` clients (every id is placed in a tuple: a count in the
    billions would exhaust the machine's memory before any check could refuse it), or None."""
    short = memory_shortfall(count, PLAN_BYTES_PER_CLIENT)
    if short is None:
        return None
    return (f"config key 'clients.count': {count:,} clients need about {short[0] / 2**30:,.1f} GiB of memory to "
            f"plan their processes here alone, more than the {short[1] / 2**30:.1f} GiB this machine has available")


def client_blocks(count: int, processes: int) -> list[list[int]]:
    """Indices 0..count-1 split into `processes` contiguous, near-equal blocks (at most `count`)."""
    processes = max(1, min(processes, count))
    base, extra = divmod(count, processes)
    out, start = [], 0
    for p in range(processes):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def build_plan(edges: Sequence[Sequence[int]], placement: Sequence[Placement]) -> ProcessPlan:
    """The server, one edge per cluster in `edges` (none: a star), and the client processes of each
    placement group: its clients grouped by parent, each group split into `per_parent` blocks."""
    procs = [PlannedProcess(SERVER, "server", None)]
    edge_of: dict[int, int] = {}
    for e, cluster in enumerate(edges):
        procs.append(PlannedProcess(edge_node(e), "edge", SERVER, tuple(cluster), edge=e))
        edge_of.update((c, e) for c in cluster)
    k = 0
    for g, place in enumerate(placement):
        by_parent: dict[int | None, list[int]] = {}
        for c in place.clients:
            by_parent.setdefault(edge_of.get(c), []).append(c)
        for pe in sorted(by_parent, key=lambda x: -1 if x is None else x):   # pe: the parent edge, or None
            ids = by_parent[pe]
            for block in client_blocks(len(ids), place.per_parent):
                procs.append(PlannedProcess(client_proc_node(k), "client", SERVER if pe is None else edge_node(pe),
                                            tuple(ids[i] for i in block), edge=pe, group=g))
                k += 1
    return ProcessPlan(tuple(procs))


def star_plan(cfg: Any, placement: Sequence[Placement] | None = None) -> ProcessPlan:
    """Every client process under the server; by default `clients.processes` blocks."""
    if placement is None:
        placement = [Placement(tuple(range(cfg.clients.count)), cfg.clients.processes)]
    return build_plan([], placement)


def edge_plan(cfg: Any, placement: Sequence[Placement] | None = None) -> ProcessPlan:
    """One edge per cluster; by default each cluster split into max(1, processes // edges) blocks."""
    clusters = cluster_assignment(cfg)
    if placement is None:
        placement = [Placement(tuple(range(cfg.clients.count)), max(1, cfg.clients.processes // len(clusters)))]
    return build_plan(clusters, placement)
