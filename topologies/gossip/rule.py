"""Gossip learning (D-PSGD, Lian et al. 2017, "Can Decentralized Algorithms Outperform
Centralized Algorithms?"): the client graph and its mixing matrix, which every process computes
from the config, once (`built_rule`); topologies/gossip/driver.py is the server's control plane,
topologies/gossip/client.py the clients'.

- **Graph.** `topology.gossip_edges`: explicit undirected edges [[0, 1], [1, 2], ...] between
  client ids; or `topology.gossip_degree = d`: a random d-regular graph drawn from the stream
  ("topology/gossip_graph") of `run.seed` (pairing model with restarts until the graph is
  simple and connected); neither: the ring 0-1-...-(n-1)-0.  Refused (one line): an id out of
  range, a self-loop, a disconnected graph, n*d odd, d >= n, both keys at once.
- **Mixing matrix** (Metropolis-Hastings weights, Xiao & Boyd 2004; symmetric and doubly
  stochastic, as D-PSGD's W must be, Lian et al. 2017 Assumption 1):
      W_ij = 1 / (1 + max(d_i, d_j))   for an edge ij,     W_ii = 1 - sum_{j in N(i)} W_ij.
- **Round** (Lian et al. 2017 Algorithm 1 in its adapt-then-combine form): every client i takes
  its local steps from x_i (the algorithm's local solver; x_i^{1/2} = x_i + Delta_i), then
      x_i <- W_ii x_i^{1/2} + sum_{j in N(i)} W_ij x_j^{1/2}.
  With one local SGD step this is X_{k+1} = (X_k - gamma dF(X_k)) W; the paper's Algorithm 1
  mixes the pre-step models instead (X_{k+1} = X_k W - gamma dF(X_k)): both converge under the
  same assumptions, and the adapt-then-combine form sends the post-step models once per round.
- **Consensus distance** (a round metric): (1/n) sum_i ||x_i - x_bar||^2 with x_bar the plain
  mean of the clients' models, which the server also evaluates (summary's final model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from sortedcontainers import SortedList

from fedhop.common.topologies.edgeweights import GraphWeights
from fedhop.common.topologies.graphs import connected, ring_graph, shown_graph
from fedhop.common.util.memo import process_memo
from fedhop.common.util.rng import numpy_stream

GRAPH_STREAM = "topology/gossip_graph"
SEND_STEP, MIX_STEP = 1, 2   # envelope steps of gossip_send/gossip_share and gossip_mix (gossip_step: 0)
MAX_RESTARTS = 1000


def graph_from_edges(edges: Any, n: int) -> list[list[int]]:
    """Sorted adjacency lists of the undirected edge list `edges` on clients 0..n-1 (validated)."""
    key = "topology.gossip_edges"
    if not isinstance(edges, list) or not edges:
        raise ValueError(f"{key}: expected a non-empty list of [i, j] client-id pairs, got {edges!r}")
    adj: list[set[int]] = [set() for _ in range(n)]
    for e in edges:
        if (not isinstance(e, list) or len(e) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in e)):
            raise ValueError(f"{key}: entry {e!r} is not a pair [i, j] of client ids")
        i, j = e
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"{key}: edge {e} names a client id out of range 0..{n - 1}")
        if i == j:
            raise ValueError(f"{key}: edge {e} is a self-loop")
        adj[i].add(j)
        adj[j].add(i)
    out = [sorted(row) for row in adj]
    if not connected(out):
        raise ValueError(f"{key}: the graph {shown_graph(out)} is not connected")
    return out


def random_regular_graph(n: int, d: int, seed: int) -> list[list[int]]:
    """A connected simple d-regular graph on n nodes from the stream (seed, GRAPH_STREAM), by the
    pairing model: node v owns the stubs v*d .. v*d+d-1, and while stubs are unpaired, a stub is
    drawn uniformly from the unpaired ones (in stub order), then its partner uniformly from the
    unpaired stubs of the other nodes that are not yet its node's neighbours.  A draw where no stub
    fits, or whose graph is disconnected, starts again from all stubs (the stream continues)."""
    key = "topology.gossip_degree"
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"{key}: got {d!r}, must be an int >= 1")
    if d >= n:
        raise ValueError(f"{key}: got {d}, must be < clients.count = {n}")
    if (n * d) % 2:
        raise ValueError(f"{key}: no {d}-regular graph on {n} clients (n * d = {n * d} is odd)")
    if d == 1 and n > 2:
        raise ValueError(f"{key}: a 1-regular graph on {n} clients is never connected")
    rng = numpy_stream(seed, GRAPH_STREAM)
    for _ in range(MAX_RESTARTS):
        graph = _pair_stubs(n, d, rng)
        if graph is not None and connected(graph):
            return graph
    raise ValueError(f"{key}: no connected {d}-regular graph on {n} clients after {MAX_RESTARTS} draws")


def _pair_stubs(n: int, d: int, rng: np.random.Generator) -> list[list[int]] | None:
    """One draw of the pairing model (`random_regular_graph`), or None where a stub has no
    partner left.  The unpaired stubs are kept sorted (a SortedList: the k-th one, and one's
    rank, in O(log n)), so a draw costs O(d^2 log n) instead of a pass over every stub.  A node's
    unpaired stubs are adjacent in that order, so the partner's rank among the fitting stubs is
    turned into its rank among all by stepping over the barred nodes' stubs, lowest node first."""
    stubs = SortedList(range(n * d))
    unpaired = [d] * n                       # each node's stubs not yet paired
    adj: list[set[int]] = [set() for _ in range(n)]
    while stubs:
        a = stubs.pop(int(rng.integers(len(stubs)))) // d
        unpaired[a] -= 1
        barred = sorted({a, *adj[a]})        # the partner's node must be neither a nor a neighbour
        fitting = len(stubs) - sum(unpaired[x] for x in barred)
        if fitting == 0:
            return None
        rank = int(rng.integers(fitting))    # among the fitting stubs, in stub order
        for x in barred:
            if not unpaired[x]:
                continue
            if stubs.bisect_left(x * d) > rank:   # x's stubs all come after the partner
                break
            rank += unpaired[x]
        b = stubs.pop(rank) // d
        unpaired[b] -= 1
        adj[a].add(b)
        adj[b].add(a)
    return [sorted(row) for row in adj]


def mh_weights(graph: Sequence[Sequence[int]]) -> GraphWeights:
    """The Metropolis-Hastings mixing matrix (module docstring), its entries on the edges and the
    diagonal only (common/topologies/edgeweights.py)."""
    deg = np.array([len(row) for row in graph], dtype=np.int64)

    def edge(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.maximum(deg[i], deg[j]))

    return GraphWeights.build(graph, edge, lambda row_sums: 1.0 - row_sums)


@dataclass(frozen=True)
class GossipRule:
    graph: list[list[int]]
    W: GraphWeights

    @classmethod
    def from_config(cls, cfg: Any) -> "GossipRule":
        from fedhop.common.topologies.graphs import topology_params
        params = topology_params(cfg)
        n = cfg.clients.count
        edges, degree = params.gossip_edges, params.gossip_degree
        if edges and degree:
            raise ValueError("topology.gossip_edges: give either gossip_edges or gossip_degree, not both")
        if edges:
            graph = graph_from_edges(edges, n)
            if n < 2:
                raise ValueError(f"topology.kind: gossip needs clients.count >= 2, got {n}")
            return cls(graph, mh_weights(graph))
        return built_rule(n, degree, cfg.run.seed if degree else 0)

    @property
    def edge_count(self) -> int:
        return sum(len(row) for row in self.graph) // 2

    def mix(self, client: int, own: dict, neighbours: dict[int, dict]) -> dict:
        """x_i <- W_ii x_i^{1/2} + sum_j W_ij x_j^{1/2} (module docstring), tensor by tensor."""
        own_weight, *weights = self.W.row(client)   # W_ii, then W_ij in the order of graph[client]
        out = {}
        for name, value in own.items():
            acc = own_weight * value
            for j, w in zip(self.graph[client], weights):
                acc = acc + w * neighbours[j][name]
            out[name] = acc.to(value.dtype)
        return out


@process_memo
def built_rule(n: int, degree: int, seed: int) -> GossipRule:
    """The rule of the random `degree`-regular graph of `seed` on n clients, or of the ring
    (`degree` 0): built once per process and kept (common/util/memo.py), since the config check,
    the driver and each client host ask for it, and at 1,000,000 clients the graph alone takes a
    minute or more."""
    graph = random_regular_graph(n, degree, seed) if degree else ring_graph(n)
    if n < 2:
        raise ValueError(f"topology.kind: gossip needs clients.count >= 2, got {n}")
    return GossipRule(graph, mh_weights(graph))


def check_config(cfg: Any) -> None:
    """What the config loader refuses for topology.kind = "gossip" (ValueError "key: why")."""
    if cfg.algorithm.name not in GOSSIP_ALGORITHMS:
        raise ValueError(f"algorithm.name: got '{cfg.algorithm.name}', but topology.kind = 'gossip' mixes the models "
                         f"x_i + Delta_i of a local solver whose reply is the update Delta_i (allowed: "
                         f"{', '.join(GOSSIP_ALGORITHMS)})")
    exchange = getattr(cfg.model, "exchange", "all")
    if exchange != "all":
        raise ValueError(f"model.exchange: got {exchange!r}, but topology.kind = 'gossip' mixes whole models "
                         f"(allowed: 'all')")
    if cfg.run.checkpoint_every:
        raise ValueError(f"run.checkpoint_every: got {cfg.run.checkpoint_every}, but topology.kind = 'gossip' keeps "
                         f"each client's model in its client process and has no checkpoints (use 0)")
    GossipRule.from_config(cfg)


# the algorithms whose client reply is a model update Delta (local model minus the model sent)
GOSSIP_ALGORITHMS = ("fedavg", "fedprox")
