"""A square matrix that is zero off a graph's edges and its diagonal, kept as those entries alone:
the chain topology's transition matrix P (topologies/chain/rule.py) and gossip's mixing matrix W
(topologies/gossip/rule.py).

Both are Metropolis-Hastings matrices: an entry for each edge ij from the two ends' degrees (and,
for the chain, their stationary weights), and the diagonal what the row's edges leave of 1.  An
N x N array holds 8 N^2 bytes (3.2 GB at 20,000 clients, in every process that reads the config);
this holds N + 2E numbers, so a ring of 1,000,000 clients takes 40 MB.  The entries are the bits
the N x N construction gives: each edge entry is computed by the same float operations, and each
diagonal entry from the row sum numpy takes over the dense row (common/numerics/rowsum.py,
from the row's entries alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from fedhop.common.numerics.rowsum import sparse_row_sums

#: an edge entry from the arrays of the edges' row and column ends (one element per edge)
EdgeRule = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: the diagonal from the sums of the rows' edge entries
DiagonalRule = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class GraphWeights:
    """Row i: `diagonal[i]` at column i, and `edge_values[starts[i]:starts[i + 1]]` at the columns
    `neighbours[i]` (ascending)."""

    neighbours: Sequence[Sequence[int]]
    starts: np.ndarray        # int64, N + 1
    edge_values: np.ndarray   # float64, one per (row, neighbour), rows in order
    diagonal: np.ndarray      # float64, N

    @classmethod
    def build(cls, graph: Sequence[Sequence[int]], edge: EdgeRule, diagonal: DiagonalRule) -> "GraphWeights":
        """The matrix of `graph` (sorted adjacency lists) whose entry at edge ij is `edge(i, j)` and
        whose diagonal is `diagonal(row sums of the edge entries)`."""
        n = len(graph)
        degrees = np.fromiter((len(row) for row in graph), dtype=np.int64, count=n)
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(degrees, out=starts[1:])
        rows = np.repeat(np.arange(n, dtype=np.int64), degrees)
        cols = np.fromiter((j for row in graph for j in row), dtype=np.int64, count=int(starts[-1]))
        values = np.asarray(edge(rows, cols), dtype=np.float64)
        return cls(graph, starts, values, diagonal(sparse_row_sums(n, starts, cols, values)))

    def __len__(self) -> int:
        return len(self.diagonal)

    def row(self, i: int) -> list[float]:
        """Row i's entries at [i, then neighbours[i] ascending], as Python floats."""
        return [float(self.diagonal[i]), *self.edge_values[self.starts[i]:self.starts[i + 1]].tolist()]

    def row_array(self, i: int) -> np.ndarray:
        """`row(i)` as a float64 array."""
        return np.concatenate(([self.diagonal[i]], self.edge_values[self.starts[i]:self.starts[i + 1]]))

    def entry(self, i: int, j: int) -> float:
        if i == j:
            return float(self.diagonal[i])
        row = self.neighbours[i]
        k = int(np.searchsorted(row, j))
        return float(self.edge_values[self.starts[i] + k]) if k < len(row) and row[k] == j else 0.0

    def dense(self) -> np.ndarray:
        """The N x N array (8 N^2 bytes: for small graphs, tests and reports)."""
        n = len(self)
        out = np.zeros((n, n))
        degrees = np.diff(self.starts)
        out[np.repeat(np.arange(n), degrees), [j for row in self.neighbours for j in row]] = self.edge_values
        out[np.arange(n), np.arange(n)] = self.diagonal
        return out
