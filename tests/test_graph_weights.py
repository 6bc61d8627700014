"""A graph's weight matrix kept as its entries on the edges and the diagonal
(common/topologies/edgeweights.py), and the row sums it takes from those entries alone
(common/numerics/rowsum.py): the same bits as the N x N construction, checked against numpy."""
from __future__ import annotations

import random

import numpy as np
import pytest

from fedhop.common.numerics import rowsum
from fedhop.common.numerics.rowsum import sparse_row_sum, sparse_row_sums
from fedhop.common.topologies.edgeweights import GraphWeights
from fedhop.common.topologies.graphs import random_graph, ring_graph
from fedhop.topologies.chain.rule import metropolis_hastings
from fedhop.topologies.gossip.rule import mh_weights, random_regular_graph


def dense_gossip(graph):
    """Gossip's Metropolis-Hastings matrix built as an N x N array, entry by entry."""
    n, deg = len(graph), [len(row) for row in graph]
    W = np.zeros((n, n))
    for i, row in enumerate(graph):
        for j in row:
            W[i, j] = 1.0 / (1.0 + max(deg[i], deg[j]))
        W[i, i] = 1.0 - W[i].sum()
    return W


def dense_walk(graph, pi):
    """The chain's transition matrix built as an N x N array, entry by entry."""
    n, deg = len(graph), np.array([len(row) for row in graph], dtype=float)
    P = np.zeros((n, n))
    for i, row in enumerate(graph):
        for j in row:
            P[i, j] = min(1.0, pi[j] * deg[i] / (pi[i] * deg[j])) / deg[i]
        P[i, i] = max(0.0, 1.0 - P[i].sum())
    return P


def test_a_row_sum_from_its_nonzeros_is_numpys_sum_of_the_whole_row():
    """Rows of every length class numpy sums differently (below 8, up to 128, longer: halves),
    with entries anywhere, including the block edges, and of very different magnitudes, so that
    another order of the same additions gives another float (the second half checks that it does)."""
    rng = random.Random(0)
    reordered_differs = 0
    for trial in range(4000):
        n = rng.choice([rng.randint(1, 9), rng.randint(8, 140), rng.randint(120, 3000), rng.randint(3000, 300_000)])
        d = rng.randint(1, min(n, 16))
        edges = [p for p in (0, 7, 8, 127, 128, n // 2, n - 1) if p < n]
        cols = sorted(set(rng.sample(range(n), d)) | set(rng.sample(edges, min(len(edges), rng.randint(0, 3)))))
        values = [rng.random() * 10.0 ** rng.randint(-9, 3) for _ in cols]
        row = np.zeros(n)
        row[cols] = values
        assert sparse_row_sum(n, cols, values) == float(row.sum()), (n, cols)
        reordered_differs += sum(values[::-1]) != float(row.sum())
    assert reordered_differs > 100   # the order matters: a sum in another order is not this one
    assert sparse_row_sum(10, [], []) == 0.0


@pytest.mark.parametrize("n", [5, 100, 129, 1_000, 4_099, 300_007])
def test_every_rows_sum_at_once_is_numpys_sum_of_each_whole_row(n, monkeypatch):
    """sparse_row_sums folds the rows of each length together: rows of 0 to 16 entries, spread out
    (one entry per run numpy sums with its running sums: the folded path) or bunched (two in one
    run: the row by row path), with magnitudes far apart, each the float np.sum gives its dense row."""
    rng = np.random.default_rng(n)
    starts, cols, values = [0], [], []
    for r in range(300):
        k = int(rng.integers(0, min(n, 16) + 1))
        if r % 3 == 0:
            at = rng.choice(n, size=k, replace=False)
        elif r % 3 == 1:     # bunched: in a window of 300 columns
            window = min(n, 300)
            at = int(rng.integers(0, n - window + 1)) + rng.choice(window, size=min(k, window), replace=False)
        else:                # spread evenly, a little jitter
            at = np.unique(np.linspace(0, n - 1, k, dtype=np.int64) + rng.integers(0, max(1, n // (4 * max(k, 1))), k))
            at = at[at < n]
        at = np.sort(at)
        cols.extend(at.tolist())
        values.extend((rng.random(len(at)) * 10.0 ** rng.integers(-9, 4, len(at))).tolist())
        starts.append(len(cols))
    starts_a, cols_a, values_a = np.array(starts), np.array(cols, dtype=np.int64), np.array(values)
    one_by_one = []
    monkeypatch.setattr(rowsum, "sparse_row_sum", lambda *a: one_by_one.append(a) or sparse_row_sum(*a))
    got = sparse_row_sums(n, starts_a, cols_a, values_a)
    assert 0 < len(one_by_one) and (n <= 128 or len(one_by_one) < 250)   # both paths taken (all one by one up to 128)
    reordered_differs = 0
    for r in range(300):
        row = np.zeros(n)
        row[cols_a[starts[r]:starts[r + 1]]] = values_a[starts[r]:starts[r + 1]]
        assert got[r] == float(row.sum()), (n, r)
        reordered_differs += float(np.sum(values_a[starts[r]:starts[r + 1]][::-1].cumsum()[-1:])) != float(row.sum())
    assert n < 200 or reordered_differs > 10   # the order of the additions matters in these rows


@pytest.mark.parametrize("n", [12, 129, 300, 1500])
def test_the_weights_are_the_bits_of_the_dense_construction(n):
    """Random graphs of degree up to 12 (rows numpy sums out of order), regular graphs, the ring
    and the complete graph: every entry the same float as the N x N construction gives."""
    rng = np.random.default_rng(n)
    graphs = [ring_graph(n), random_graph(n, 12, seed=n), random_graph(n, 3, seed=n + 1)]
    if n <= 300:
        graphs.append([[j for j in range(n) if j != i] for i in range(n)])
    d = 6 if n % 2 == 0 else 4
    if n <= 2000:
        graphs.append(random_regular_graph(n, d, seed=n))
    for graph in graphs:
        pi = rng.random(n) + 0.01
        pi /= pi.sum()
        assert np.array_equal(mh_weights(graph).dense(), dense_gossip(graph))
        assert np.array_equal(metropolis_hastings(graph, pi).dense(), dense_walk(graph, pi))


def test_rows_entries_and_the_dense_array_agree():
    graph = [[1, 2, 3], [0], [0, 3], [0, 2]]
    W = GraphWeights.build(graph, lambda i, j: (10 * i + j).astype(float), lambda sums: -sums)
    dense = np.array([[-6.0, 1.0, 2.0, 3.0],
                      [10.0, -10.0, 0.0, 0.0],
                      [20.0, 0.0, -43.0, 23.0],
                      [30.0, 0.0, 32.0, -62.0]])
    assert np.array_equal(W.dense(), dense)
    assert [W.row(i) for i in range(4)] == [[-6.0, 1.0, 2.0, 3.0], [-10.0, 10.0], [-43.0, 20.0, 23.0],
                                            [-62.0, 30.0, 32.0]]
    assert all(W.entry(i, j) == dense[i, j] for i in range(4) for j in range(4))
    assert len(W) == 4


def test_the_ring_is_each_node_joined_to_the_next_and_the_one_before():
    for n in range(1, 40):
        assert ring_graph(n) == [sorted({(c - 1) % n, (c + 1) % n} - {c}) for c in range(n)]
