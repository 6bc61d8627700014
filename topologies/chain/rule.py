"""WRWGD: weighted random-walk gradient descent over a graph of clients (Ayache & El Rouayheb
2019), the Fed-CHS paper's decentralised baseline (shared/research/seed-004.md section 3.4).

One model walks a graph of clients; there is no parameter server on the data path.

- **Graph.** `topology.graph`: explicit adjacency lists, "random" (a seeded connected graph,
  every degree <= `topology.max_degree`; the paper: at most 3), "ring" or "complete" (any
  number of clients: its rows and transition probabilities are made when a hop needs them).
- **Stationary law.** `topology.stationary`: the walk's target distribution pi.  The paper sets
  pi_i proportional to L_i, the local smoothness constant, which no neural network exposes;
  "data" (pi_i ∝ D_i, the default), "uniform", or a list of positive per-client weights (L_i
  where the user knows them).
- **Transition rule** (Metropolis-Hastings with a uniform proposal over the neighbours, so the
  stationary law is pi):  P_ij = (1/d_i) min(1, pi_j d_i / (pi_i d_j)) for j in N(i), and
  P_ii = 1 - sum_j P_ij (the proposal was rejected: the model stays).
- **Importance weight.** The walk visits i with frequency pi_i, so the step is scaled to stay
  unbiased for the objective F = sum_i p_i f_i:  w <- w - eta (p_i / pi_i) grad f_i(w).  With
  the paper's objective p_i = 1/N (`topology.objective = "uniform"`, the default) this is
  the digest's  w <- w - (eta / (N pi_i)) grad f_i(w);  "data" takes p_i = D_i / D_A.
- **K local steps per visit** (`algorithm.local_steps`; the paper: 20).  The visited client runs
  the algorithm's local solver from w and the walk takes w <- w + (p_i / pi_i) Delta_i.  With
  K = 1 this is exactly the step above; for K > 1 it scales the K-step update (an extension:
  the paper states only the one-step rule).
- **Draws.** The start client is uniform from the stream ("walk/start") unless
  `topology.start` names one; hop h of round r moves by one uniform draw u from the stream
  ("walk", r, h): the next client is the first candidate, in the order [i, then N(i) ascending],
  whose cumulative probability exceeds u.

Every process computes the same `WalkRule` from the config, so the rule lives here alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from fedhop.common.topologies.edgeweights import GraphWeights
from fedhop.common.topologies.graphs import CompleteGraph
from fedhop.common.util.memo import process_memo
from fedhop.common.util.rng import numpy_stream


def client_graph(spec: str | list, num: int, max_degree: int, seed: int) -> Sequence[Sequence[int]]:
    """The walk's client graph as sorted adjacency lists: a given one validated (symmetric,
    connected), or a built-in kind, which is both by construction ("complete" made on demand,
    common/topologies/graphs.py `CompleteGraph`)."""
    from fedhop.common.topologies.graphs import check_graph
    if isinstance(spec, list):
        return check_graph(spec, num, "topology.graph", "client ids")
    if spec == "complete":
        return CompleteGraph(num)
    if spec == "ring":
        return built_graph(spec, num, 0, 0)
    if spec == "random":
        return built_graph(spec, num, max_degree, seed)
    raise ValueError(f"topology.graph: got {spec!r}, allowed: \"random\", \"ring\", \"complete\" or adjacency "
                     f"lists [[1, 2], ...]")


@process_memo
def built_graph(kind: str, num: int, max_degree: int, seed: int) -> list[list[int]]:
    """A built-in client graph ("ring", or "random" of `max_degree` and `seed`), built once per
    process and kept (common/util/memo.py): the config check, the driver and each client host
    ask for it, and the seeded "random" one takes seconds at 1,000,000 clients."""
    from fedhop.common.topologies.graphs import random_graph, ring_graph
    if kind == "ring":
        return ring_graph(num)
    return random_graph(num, max_degree, seed, stream="topology/client_graph")


def _mh_edges(pi: np.ndarray, deg: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """P_ij = (1/d_i) min(1, pi_j d_i / (pi_i d_j)) at the edges (i[k], j[k])."""
    return np.minimum(1.0, pi[j] * deg[i] / (pi[i] * deg[j])) / deg[i]


def metropolis_hastings(graph: Sequence[Sequence[int]], pi: np.ndarray) -> "GraphWeights | CompleteWeights":
    """P with P_ij = (1/d_i) min(1, pi_j d_i / (pi_i d_j)) on the graph's edges and the rest
    of each row on the diagonal: a reversible chain whose stationary law is pi (its entries on
    the edges and the diagonal only: common/topologies/edgeweights.py; on the complete graph a
    row at a time, `CompleteWeights`)."""
    if isinstance(graph, CompleteGraph):
        return CompleteWeights(np.asarray(pi, dtype=np.float64))
    deg = np.array([len(row) for row in graph], dtype=float)
    return GraphWeights.build(graph, lambda i, j: _mh_edges(pi, deg, i, j),
                              lambda row_sums: np.maximum(0.0, 1.0 - row_sums))


@dataclass(frozen=True)
class CompleteWeights:
    """The Metropolis-Hastings matrix on the complete graph of len(pi) clients, each row made
    when asked (O(N) time and memory; nothing N x N is kept).  Its entries are the bits that
    `GraphWeights.build` gives over the complete graph's lists: the same float operations on
    each edge, and the diagonal from numpy's sum of the dense row (tests/test_chain.py)."""

    pi: np.ndarray

    def __len__(self) -> int:
        return len(self.pi)

    def _dense(self, i: int) -> tuple[float, np.ndarray]:
        """(P_ii, row i with its edge entries in place and 0 at column i)."""
        n = len(self.pi)
        if n == 1:
            return 1.0, np.zeros(1)
        d = float(n - 1)   # every degree
        dense = np.minimum(1.0, self.pi * d / (self.pi[i] * d)) / d   # `_mh_edges` at every column
        dense[i] = 0.0
        return float(np.maximum(0.0, 1.0 - np.sum(dense))), dense

    def row_array(self, i: int) -> np.ndarray:
        """Row i's entries at [i, then every other client ascending]."""
        diagonal, dense = self._dense(i)
        return np.concatenate(([diagonal], dense[:i], dense[i + 1:]))

    def entry(self, i: int, j: int) -> float:
        diagonal, dense = self._dense(i)
        return diagonal if i == j else float(dense[j])

    def dense(self) -> np.ndarray:
        """The N x N array (8 N^2 bytes: for small graphs, tests and reports)."""
        rows = []
        for i in range(len(self)):
            diagonal, row = self._dense(i)
            row[i] = diagonal
            rows.append(row)
        return np.array(rows)


@dataclass(frozen=True)
class WalkRule:
    graph: Sequence[Sequence[int]]
    pi: np.ndarray           # stationary law
    p: np.ndarray            # objective weights p_i
    P: GraphWeights | CompleteWeights   # transition matrix
    seed: int

    @classmethod
    def from_config(cls, cfg: Any, sizes: Sequence[int]) -> "WalkRule":
        from fedhop.common.topologies.graphs import topology_params
        params = topology_params(cfg)
        graph = client_graph(params.graph, cfg.clients.count, params.max_degree, cfg.run.seed)
        sizes_a = np.asarray(sizes, dtype=float)
        pi = _weights(params.stationary, sizes_a, "topology.stationary")
        p = _weights(params.objective, sizes_a, "topology.objective")
        return cls(graph, pi, p, metropolis_hastings(graph, pi), cfg.run.seed)

    def scale(self, client: int) -> float:
        """The importance weight p_i / pi_i of a visit to `client`."""
        return float(self.p[client] / self.pi[client])

    def is_candidate(self, client: int, other: object) -> bool:
        """Whether the model can go from `client` to `other`: itself (a rejected proposal) or a neighbour."""
        return other == client or other in self.graph[client]

    def next_client(self, client: int, round: int, hop: int) -> int:
        """The client after `client` at hop `hop` of `round` (module docstring, "Draws")."""
        u = numpy_stream(self.seed, "walk", round, hop).random()
        cum = np.cumsum(self.P.row_array(client))   # over [client, then its neighbours ascending]
        idx = min(int(np.searchsorted(cum, u, side="right")), len(cum) - 1)
        return client if idx == 0 else int(self.graph[client][idx - 1])


def start_client(start: int | str, num: int, seed: int) -> int:
    """The walk's first client: `topology.start` as given, or uniform from ("walk/start")."""
    if start == "random":
        return int(numpy_stream(seed, "walk/start").integers(num))
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < num:
        raise ValueError(f"topology.start: got {start!r}, allowed: \"random\" or a client id 0..{num - 1}")
    return start


def _weights(spec: str | list, sizes: np.ndarray, key: str) -> np.ndarray:
    n = len(sizes)
    if spec == "data":
        w = sizes
    elif spec == "uniform":
        w = np.ones(n)
    elif isinstance(spec, list):
        if len(spec) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in spec):
            raise ValueError(f"{key}: a list needs {n} positive numbers (one per client), got {spec!r}")
        w = np.asarray(spec, dtype=float)
    else:
        raise ValueError(f"{key}: got {spec!r}, allowed: \"data\", \"uniform\" or a list of {n} positive weights")
    return w / w.sum()
