"""The seeded "random" graph (common/topologies/randomgraph.py) against its rule written as stated:
the same draws, so the same graph, at every size, degree and seed tried, through both ways step
2 visits the pairs (blocks, then the free nodes' pairs alone)."""
from __future__ import annotations

import numpy as np
import pytest

from fedhop.common.topologies import randomgraph
from fedhop.common.topologies.randomgraph import FreeSlots, PairIndex, random_graph
from fedhop.common.util.rng import numpy_stream


def literal_rule(num: int, max_degree: int, seed: int, stream: str = "topology/graph") -> list[list[int]]:
    """The module docstring's rule, step by step over Python lists of every free node and every pair."""
    if num == 1:
        return [[]]
    if max_degree < 2 and num > 2:
        raise ValueError("max_degree")
    rng = numpy_stream(seed, stream)
    order = [int(v) for v in rng.permutation(num)]
    adj: list[set[int]] = [set() for _ in range(num)]
    for i, v in enumerate(order[1:], start=1):
        free = [u for u in order[:i] if len(adj[u]) < max_degree]
        u = free[int(rng.integers(len(free)))]
        adj[u].add(v)
        adj[v].add(u)
    pairs = [(a, b) for a in range(num) for b in range(a + 1, num) if b not in adj[a]]
    for j in rng.permutation(len(pairs)):
        a, b = pairs[int(j)]
        if len(adj[a]) < max_degree and len(adj[b]) < max_degree and rng.random() < 0.5:
            adj[a].add(b)
            adj[b].add(a)
    return [sorted(n) for n in adj]


def _either(build, *args):
    try:
        return build(*args)
    except ValueError:
        return "refused"


def test_the_graph_is_the_literal_rules_at_every_size_degree_and_seed(monkeypatch):
    late = []
    real = randomgraph._free_pairs
    monkeypatch.setattr(randomgraph, "_free_pairs", lambda *a: late.append(1) or real(*a))
    sizes = list(range(1, 24)) + [41, 97, 250, 613]
    for num in sizes:
        for max_degree in (0, 1, 2, 3, 5, 8, 40):
            for seed in (0, 7):
                expected = _either(literal_rule, num, max_degree, seed, "topology/client_graph")
                assert _either(random_graph, num, max_degree, seed, "topology/client_graph") == expected, \
                    (num, max_degree, seed)
    assert late   # the free nodes' pairs alone were looked up in some of them
    graph = random_graph(613, 5, 3)
    assert all(len(row) <= 5 for row in graph) and all(v in graph[u] for v, row in enumerate(graph) for u in row)
    assert random_graph(613, 5, 3) != random_graph(613, 5, 4)


def test_the_pair_numbering_round_trips_with_pairs_left_out():
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 517, 1500):
        full = n * (n - 1) // 2
        left_out = rng.choice(full, size=min(full - 1, 3 * n // 2), replace=False)
        a, b = np.triu_indices(n, 1)   # every pair, in lexicographic order: full index = position
        index = PairIndex(n, (a[left_out], b[left_out]))
        kept = np.setdiff1d(np.arange(full), left_out)
        assert index.count == len(kept)
        got_a, got_b = index.pairs(np.arange(index.count))
        assert np.array_equal(got_a, a[kept]) and np.array_equal(got_b, b[kept])
        assert np.array_equal(index.numbered(index.full_index(got_a, got_b)), np.arange(index.count))
    for n in (10_000, 100_003):   # where each row starts and ends, at sizes where the root is rounded
        index = PairIndex(n, (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)))
        rows = np.arange(n - 1)
        starts = index.row_start[rows]
        for k, b in ((starts, rows + 1), (starts + (n - 2 - rows), np.full(n - 1, n - 1))):
            got_a, got_b = index.pairs(k)
            assert np.array_equal(got_a, rows) and np.array_equal(got_b, b)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_free_slots_find_the_kth_set_position(n):
    rng = np.random.default_rng(n)
    slots, present = FreeSlots(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        p = int(rng.integers(n))
        slots.add(p, -1 if present[p] else 1)
        present[p] = not present[p]
        where = np.flatnonzero(present)
        for k in range(len(where)):
            assert slots.kth(k) == where[k]


def test_a_graph_past_the_literal_size_has_the_literal_rules_law(monkeypatch):
    """Past LITERAL_MAX_NODES the graph is drawn with the rule's law from other draws: on 5 nodes
    of degree at most 2 (72 graphs: Hamiltonian paths and cycles) the literal rule and the drawn
    one (with every pair listed at once and visited in a drawn order, and with pairs drawn from the
    free nodes down to 2 free) give each graph as often, within the sampling spread, over 8,000 seeds; on
    7 nodes of degree at most 3 (where step 2 has choices), the same spread of edge counts,
    degree sequences and edges among three given nodes together."""
    from collections import Counter

    def law(num: int, max_degree: int, key) -> Counter:
        return Counter(key(random_graph(num, max_degree, seed)) for seed in range(8_000))

    def shape(g):   # the edge count, the degrees, and the edges among nodes 0-2 (where a pair order would show)
        return sum(map(len, g)) // 2, tuple(sorted(map(len, g))), sum(b in g[a] for a in range(3) for b in range(a))

    literal = [law(5, 2, str), law(7, 3, shape)]
    monkeypatch.setattr(randomgraph, "LITERAL_MAX_NODES", 0)
    monkeypatch.setattr(randomgraph, "LISTED_PER_SLOT", 0)
    for listed_free in (256, 2):   # list every pair at once; draw pairs until 2 nodes are free
        monkeypatch.setattr(randomgraph, "LISTED_FREE", listed_free)
        drawn = [law(5, 2, str), law(7, 3, shape)]
        assert len(literal[0]) == len(drawn[0]) == 72
        for a, b in zip(literal, drawn):
            kinds = set(a) | set(b)
            statistic = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in kinds)   # two samples of one law: chi-square
            df, z = len(kinds) - 1, 4.75                                          # z: a chance of 1e-6 of refusing the same law
            limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3   # its 1 - 1e-6 quantile (Wilson-Hilferty)
            assert statistic < limit, (listed_free, statistic, df)
    assert random_graph(7, 3, 5) == random_graph(7, 3, 5)   # seeded


def test_a_graph_of_300000_nodes_is_bounded_connected_and_seeded_with_few_nodes_short():
    """300,000 nodes of degree at most 3 (the literal rule would order 4.5 * 10^10 pairs): every
    degree 1 to 3, symmetric, connected, and all but a handful of nodes full."""
    from fedhop.common.topologies.graphs import connected
    graph = random_graph(300_000, 3, 2, "topology/client_graph")
    degrees = np.array([len(row) for row in graph])
    assert degrees.min() >= 1 and degrees.max() == 3 and (degrees < 3).sum() < 50
    assert all(u in graph[v] for u in range(0, 300_000, 97) for v in graph[u])
    assert connected(graph)


def test_a_dense_graph_past_the_literal_size_is_drawn_with_the_rules_edge_count():
    """Past LITERAL_MAX_NODES with max_degree at N - 1 no node fills, so every pair not in the tree
    draws once and is joined with chance 1/2: the edge count is (N - 1) + Binomial(P - (N - 1), 1/2),
    P = N (N - 1) / 2 (within 6 standard deviations), the graph symmetric, bounded and connected.
    At max_degree N / 2 the degrees stay bounded.  Both are graphs where the listed pairs number
    millions (`_visit_listed`)."""
    from fedhop.common.topologies.graphs import connected
    for num, max_degree in ((2_200, 2_199), (2_500, 1_250)):
        graph = random_graph(num, max_degree, 3)
        degrees = np.array([len(row) for row in graph])
        assert degrees.min() >= 1 and degrees.max() <= max_degree
        a = np.repeat(np.arange(num), degrees)
        b = np.concatenate([np.array(row, dtype=np.int64) for row in graph])
        assert (a != b).all() and np.array_equal(np.sort(a * num + b), np.sort(b * num + a))
        assert connected(graph)
        if max_degree == num - 1:
            drawing = num * (num - 1) // 2 - (num - 1)
            assert abs(degrees.sum() // 2 - (num - 1) - drawing / 2) < 6 * (drawing / 4) ** 0.5
