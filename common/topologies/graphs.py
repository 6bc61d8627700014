"""Topologies as data: which edge serves which clients, and each topology's own keys.

A topology is a `[topology]` config section.  Its common keys are `kind`, `edges` and
`assignment`; the keys that only one kind has live in that kind's params dataclass, declared by
its spec (common/topologies/), and are validated by the config loader
(`register_options_schema("topology", "kind", ...)`).
"""
from __future__ import annotations

import bisect
import itertools
from collections import Counter
from typing import Any, Iterator, Sequence

from fedhop.common.topologies import builtin_specs, spec_for
from fedhop.common.topologies.randomgraph import random_graph  # noqa: F401  # re-exported: the seeded "random" graph
from fedhop.common.util.nodeids import edge_index, edge_node  # noqa: F401  # re-exported: the topology's node names
from fedhop.common.util.rng import numpy_stream
from fedhop.common.util.views import IndexedView

# kind -> its params dataclass (None: no own keys), read from the built-in specs (common/topologies/ and
# the folders topologies/<kind>/)
TOPOLOGY_PARAMS: dict[str, type | None] = {kind: spec.params for kind, spec in builtin_specs().items()}


def topology_params_class(kind: str) -> type | None:
    """The params dataclass of topology `kind`, built in or a plug-in's (common/topologies
    `spec_for`).  Raises KeyError for an unknown kind, PluginError (a ValueError) for a plug-in
    that does not load."""
    return spec_for(kind).params


def topology_params(cfg: Any) -> Any:
    """The validated params of cfg.topology (built from `options` if the loader did not)."""
    params = getattr(cfg.topology, "params", None)
    if params is not None:
        return params
    cls = topology_params_class(cfg.topology.kind)
    return cls(**cfg.topology.options) if cls is not None else None


def cluster_assignment(cfg: Any) -> list[list[int]]:
    """Client ids per edge.

    `assignment = "blocks"`: contiguous blocks of ids (edge e gets the e-th block; sizes differ
    by at most one).  `"shuffled"`: the same after a seeded permutation (stream
    "topology/assignment").  A list of lists: exactly those clients per edge.
    """
    count, edges = cfg.clients.count, cfg.topology.edges
    spec = cfg.topology.assignment
    if isinstance(spec, list):
        return [sorted(int(c) for c in group) for group in spec]
    if edges < 1:
        raise ValueError(f"topology.edges must be >= 1 for topology.kind = '{cfg.topology.kind}'")
    ids = list(range(count))
    if spec == "shuffled":
        ids = [int(i) for i in numpy_stream(cfg.run.seed, "topology/assignment").permutation(count)]
    elif spec != "blocks":
        raise ValueError(f"topology.assignment: got '{spec}', allowed: blocks, shuffled, or a list of client lists")
    base, extra = divmod(count, edges)
    out, start = [], 0
    for e in range(edges):
        size = base + (1 if e < extra else 0)
        out.append(sorted(ids[start:start + size]))
        start += size
    return out


def round_edges(cfg: Any, round: int) -> list[int] | None:
    """The edges taking part in `round` of a hierarchical run: None (all) when
    `topology.edges_per_round` is 0 or the kind has no such key (only hierarchical has), else
    that many edges drawn uniformly without replacement from the stream ("edges", round), sorted."""
    per_round = getattr(topology_params(cfg), "edges_per_round", 0)
    if per_round == 0:
        return None
    edges = len(cluster_assignment(cfg))
    drawn = numpy_stream(cfg.run.seed, "edges", round).choice(edges, size=min(per_round, edges), replace=False)
    return sorted(int(e) for e in drawn)


def sampling_pool(cfg: Any, round: int) -> Sequence[int]:
    """The client ids a round samples from, in id order: every client (a `range`, so a round costs
    nothing per registered client), or those of the round's edges."""
    edges = round_edges(cfg, round)
    if edges is None:
        return range(cfg.clients.count)
    clusters = cluster_assignment(cfg)
    return sorted(c for e in edges for c in clusters[e])


# ----------------------------------------------------------------------------- sequential (Fed-CHS)
def connected(adj: Sequence[Sequence[int]]) -> bool:
    """Whether the graph given as adjacency lists is connected (a walk from node 0 reaches all)."""
    seen, todo = {0}, [0]
    while todo:
        for v in adj[todo.pop()]:
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return len(seen) == len(adj)


def ring_graph(num: int) -> list[list[int]]:
    """The ring 0-1-...-(num-1)-0 as sorted adjacency lists (two clients: one edge; one: none)."""
    if num <= 2:
        return [[1 - c] if num == 2 else [] for c in range(num)]
    return [[1, num - 1]] + [[c - 1, c + 1] for c in range(1, num - 1)] + [[0, num - 2]]


class AllBut(IndexedView[int]):
    """The neighbours of `node` in the complete graph of `num` nodes: every other id, ascending,
    without a list of them (a list per node would hold all N(N-1) ordered pairs)."""

    def __init__(self, node: int, num: int) -> None:
        self.node, self.num = node, num

    def __len__(self) -> int:
        return self.num - 1

    def _at(self, k: int) -> int:
        return k if k < self.node else k + 1

    def __contains__(self, j: object) -> bool:
        return isinstance(j, int) and not isinstance(j, bool) and 0 <= j < self.num and j != self.node

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(range(self.node), range(self.node + 1, self.num))

    def __repr__(self) -> str:
        return f"every node of 0..{self.num - 1} but {self.node}"


class CompleteGraph(IndexedView[AllBut]):
    """The complete graph of `num` nodes as adjacency "lists" (`AllBut`) made on demand: O(1) memory."""

    def __init__(self, num: int) -> None:
        self.num = num

    def __len__(self) -> int:
        return self.num

    def _at(self, i: int) -> AllBut:
        return AllBut(i, self.num)

    @property
    def edge_count(self) -> int:
        return self.num * (self.num - 1) // 2

    def __repr__(self) -> str:
        return f"the complete graph of {self.num:,} nodes"


#: the most clients whose graph summary.json lists (`graph_summary`), and the most entries those
#: lists may hold (2|E|: the complete graph of 2,000 clients holds 3,998,000); a larger graph is
#: the config's to rebuild (its kind and run.seed, or the lists it gives)
SUMMARY_GRAPH_MAX = 10_000
SUMMARY_GRAPH_ENTRIES = 4_000_000


def graph_summary(graph: Sequence[Sequence[int]]) -> dict[str, Any]:
    """summary.json's description of a client graph: its edge count, and its adjacency lists up
    to SUMMARY_GRAPH_MAX clients and SUMMARY_GRAPH_ENTRIES entries (a ring of 1,000,000 clients
    would add 18 MB, the complete graph of 10,000 clients 600 MB)."""
    edges = graph.edge_count if isinstance(graph, CompleteGraph) else sum(len(row) for row in graph) // 2
    out: dict[str, Any] = {"client_graph_edges": edges}
    if len(graph) <= SUMMARY_GRAPH_MAX and 2 * edges <= SUMMARY_GRAPH_ENTRIES:
        out["client_graph"] = [list(row) for row in graph] if isinstance(graph, CompleteGraph) else graph
    return out


def visit_counts(walk: Sequence[int]) -> dict[int, int]:
    """summary.json's `client_visits`: the visits of each visited client, in id order (a client
    never visited is not listed, so the record does not grow with the clients registered)."""
    return dict(sorted(Counter(walk).items()))


def shown_row(row: Sequence[int], most: int = 20) -> str:
    """A node's neighbours for an error message: the ids, or the first `most` and their count."""
    if len(row) > most:
        return f"{', '.join(map(str, row[:most]))}, ... ({len(row):,} in all)"
    return ", ".join(map(str, row))


def shown_graph(adj: Sequence[Sequence[int]], most: int = 20) -> str:
    """Adjacency lists for an error message: the lists themselves, or their count when longer
    than `most` (an error stays one readable line)."""
    return str([list(row) for row in adj]) if len(adj) <= most else f"of {len(adj):,} adjacency lists"


def check_graph(spec: list, num: int, key: str, what: str) -> list[list[int]]:
    """Adjacency lists validated: one list of other node ids 0..num-1 per node, symmetric,
    connected; returned sorted."""
    if len(spec) != num:
        raise ValueError(f"{key}: {len(spec)} adjacency lists for {num} nodes")
    adj = []
    for e, row in enumerate(spec):
        if not isinstance(row, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in row):
            raise ValueError(f"{key}: entry {e} must be a list of {what}, got {row!r}")
        bad = [v for v in row if not 0 <= v < num or v == e]
        if bad:
            raise ValueError(f"{key}: entry {e} lists {bad}; neighbours are other {what} 0..{num - 1}")
        adj.append(sorted(set(row)))
    for e, row in enumerate(adj):
        for v in row:
            back = adj[v]   # sorted: e looked up by bisection, not by a scan of a long row
            k = bisect.bisect_left(back, e)
            if k == len(back) or back[k] != e:
                raise ValueError(f"{key}: not symmetric, {v} is in entry {e} but {e} is not in entry {v}")
    if not connected(adj):
        raise ValueError(f"{key}: the graph {shown_graph(adj)} is not connected")
    return adj


SEQ_METRIC_PREFIX = "metric:"   # scalars of a Fed-CHS round reply that are the edge's evaluation of the model
