"""Gossip learning (D-PSGD, Lian et al. 2017, "Can Decentralized Algorithms Outperform
Centralized Algorithms?"): the client graph and its mixing matrix, which every process computes
from the config, once (`built_rule`); topologies/gossip/driver.py is the server's control plane,
topologies/gossip/client.py the clients'.

- **Graph.** `topology.gossip_edges`: explicit undirected edges [[0, 1], [1, 2], ...] between
  client ids; or `topology.gossip_degree = d`: a random connected d-regular graph drawn from
  the stream ("topology/gossip_graph") of `run.seed` (`random_regular_graph`: the pairing model
  in passes, drawn again until connected; for d = 2 a uniform cycle; for d > (n - 1) / 2 the
  complement of an (n - 1 - d)-regular pairing); neither: the ring
  0-1-...-(n-1)-0.  Refused (one line): an id out of
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

from fedhop.common.topologies.edgeweights import GraphWeights
from fedhop.common.topologies.graphs import connected, ring_graph, shown_graph
from fedhop.common.util.memo import process_memo
from fedhop.common.util.rng import numpy_stream

GRAPH_STREAM = "topology/gossip_graph"
SEND_STEP, MIX_STEP = 1, 2   # envelope steps of gossip_send/gossip_share and gossip_mix (gossip_step: 0)
MAX_RESTARTS = 1000
SWITCH_DRAWS = 10_000   # edges drawn for one switch (`_switch`) before a draw starts again


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
    """A connected simple d-regular graph on n nodes from the stream (seed, GRAPH_STREAM).

    d = 2: a connected 2-regular graph is one cycle through every node, drawn as the cycle
    order[0]-order[1]-...-order[n-1]-order[0], order = permutation(n) (uniform over them; a
    drawn-until-connected pairing would need about sqrt(n) draws).  d >= 3 and d > (n - 1) / 2:
    the complement of an (n - 1 - d)-regular graph drawn by the pairing model in passes
    (`_pair_stubs`, drawn again only where a draw ends short), since complementing maps the
    (n - 1 - d)-regular graphs one to one onto the d-regular ones and every graph whose degrees
    are all at least (n - 1) / 2 is connected (two nodes not joined have more than n - 2
    neighbours between them, so one in common).  Pairing d stubs a node directly is slow there:
    almost every pair a pass draws is joined already, and a last pair's switch rarely fits.
    Otherwise: draws of the pairing model in passes until one is connected, the
    stream continuing."""
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
    if d == 2:
        return _cycle(rng.permutation(n)).tolist()
    if 2 * d > n - 1:
        for _ in range(MAX_RESTARTS):
            sparse = _pair_stubs(n, n - 1 - d, rng)
            if sparse is not None:
                return _complement(sparse).tolist()
        raise ValueError(f"{key}: no {d}-regular graph on {n} clients after {MAX_RESTARTS} draws")
    for _ in range(MAX_RESTARTS):
        adj = _pair_stubs(n, d, rng)
        if adj is not None and _connected(adj):
            return adj.tolist()
    raise ValueError(f"{key}: no connected {d}-regular graph on {n} clients after {MAX_RESTARTS} draws")


def _cycle(order: np.ndarray) -> np.ndarray:
    """The sorted neighbour pairs (n x 2) of the cycle through `order`."""
    adj = np.empty((len(order), 2), dtype=np.int64)
    adj[order, 0] = np.roll(order, 1)
    adj[order, 1] = np.roll(order, -1)
    adj.sort(axis=1)
    return adj


def _complement(adj: np.ndarray) -> np.ndarray:
    """The sorted neighbour lists (n x (n - 1 - k)) of the complement of the graph `adj` (n x k)."""
    n, k = adj.shape
    joined = np.ones((n, n), dtype=bool)
    np.fill_diagonal(joined, False)
    joined[np.repeat(np.arange(n), k), adj.ravel()] = False
    return np.nonzero(joined)[1].reshape(n, n - 1 - k)


def _pair_stubs(n: int, d: int, rng: np.random.Generator) -> np.ndarray | None:
    """One draw of the pairing model in passes (Steger & Wormald's scheme, a pass at a time): the
    sorted neighbour lists (n x d), or None where the draw ends short of d-regular.

    Every node has d stubs; the unpaired stubs, written as their nodes in ascending order, are
    ordered by `permutation(len)` and paired up consecutively (first with second, ...).  A pair
    u, v becomes the edge uv unless u = v, u and v are joined already, or an earlier pair of the
    same pass is the same pair; the stubs of the other pairs are the next pass's.  After a pass
    that joins nothing, where no two remaining nodes can be joined (distinct, not yet joined),
    the first two remaining stubs are joined to an edge's ends instead (`_switch`)."""
    stubs = np.repeat(np.arange(n, dtype=np.int64), d)
    joined = np.empty(0, dtype=np.int64)      # the edges so far as u * n + v, u < v, ascending
    while stubs.size:
        ordered = stubs[rng.permutation(stubs.size)]
        left, right = ordered[0::2], ordered[1::2]          # each pair's two stubs
        pairs = np.stack([np.minimum(left, right), np.maximum(left, right)], axis=1)
        keys = pairs[:, 0] * n + pairs[:, 1]
        first = np.zeros(len(keys), dtype=bool)
        first[np.unique(keys, return_index=True)[1]] = True   # the first pair of its kind in the pass
        edge = first & ~_among(keys, joined) & (pairs[:, 0] != pairs[:, 1])
        new = np.sort(keys[edge])
        joined = np.insert(joined, np.searchsorted(joined, new), new)
        stubs = np.sort(pairs[~edge].ravel())
        if not edge.any() and not _joinable(np.unique(stubs), joined, n, d):
            switched = _switch(int(stubs[0]), int(stubs[1]), joined, n, rng)
            if switched is None:
                return None
            joined, stubs = switched, stubs[2:]
    low, high = joined // n, joined % n
    both_ways = np.sort(np.concatenate([joined, high * n + low]))   # node * n + neighbour, ascending
    return (both_ways % n).reshape(n, d)


def _switch(u: int, v: int, joined: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """The edges with a drawn edge xy replaced by ux and vy: every node keeps its degree but u and
    v, which gain one each (u two where u = v).  The edge is drawn with its direction, k =
    integers(2E): the (k // 2)-th edge in ascending order, low end first for even k, again until
    neither x nor y is u or v, x is not u's neighbour and y not v's (at most SWITCH_DRAWS draws;
    None after them)."""
    for _ in range(SWITCH_DRAWS):
        k = int(rng.integers(2 * len(joined)))
        low, high = divmod(int(joined[k // 2]), n)
        x, y = (low, high) if k % 2 == 0 else (high, low)
        ux, vy = min(u, x) * n + max(u, x), min(v, y) * n + max(v, y)
        if x in (u, v) or y in (u, v) or _among(np.array([ux, vy]), joined).any():
            continue
        kept = np.delete(joined, k // 2)
        added = np.array(sorted((ux, vy)), dtype=np.int64)
        return np.insert(kept, np.searchsorted(kept, added), added)
    return None


def _joinable(nodes: np.ndarray, joined: np.ndarray, n: int, d: int) -> bool:
    """Whether two of `nodes` (distinct, each with an unpaired stub) are not yet joined.  A node
    with a free stub has at most d - 1 neighbours, so among d + 1 or more nodes it has a
    non-neighbour."""
    if len(nodes) > d:
        return True
    u, v = np.triu_indices(len(nodes), 1)
    return not _among(nodes[u] * n + nodes[v], joined).all()


def _among(keys: np.ndarray, ascending: np.ndarray) -> np.ndarray:
    """Which of `keys` are in the ascending array `ascending`."""
    at = np.searchsorted(ascending, keys)
    found = at < len(ascending)
    found[found] = ascending[at[found]] == keys[found]
    return found


def _connected(adj: np.ndarray) -> bool:
    """Whether the graph of neighbour lists `adj` (n x d) is connected: a breadth-first walk from
    node 0, a level at a time over the array (common/topologies/graphs.py `connected` walks
    Python lists node by node: 2.7 s at 1,000,000 nodes against 0.05 s here)."""
    seen, reached = np.zeros(len(adj), dtype=bool), np.zeros(len(adj), dtype=bool)
    seen[0] = True
    level = np.zeros(1, dtype=np.int64)
    while level.size:
        reached[adj[level].ravel()] = True
        reached &= ~seen
        level = np.flatnonzero(reached)
        seen[level] = True
        reached[level] = False
    return bool(seen.all())


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
