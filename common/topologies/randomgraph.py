"""The seeded "random" client or edge graph (`random_graph`): connected, every degree at most
`max_degree`, drawn by a rule stated over all N(N-1)/2 node pairs and built here without a loop
over them.

The rule (the draws that decide a graph, in this order, from one stream):

1. `order = permutation(N)`.  A spanning tree: for i = 1..N-1, node order[i] is joined to the
   k-th node, k = integers(F), of the F nodes among order[0..i-1] (in that order) whose degree is
   below `max_degree`.
2. The pairs (a, b), a < b, in lexicographic order, the tree's edges left out: P of them.
   `permutation(P)` orders them; each pair in that order whose two ends both still have a free
   degree at its turn draws `random()` and is joined when the draw is below 1/2.  A pair whose end
   is full at its turn draws nothing.

Built literally, step 1 rescans the tree's free nodes for every node (O(N^2)) and step 2 holds
and visits P ~ N^2/2 pairs in Python: 3 s at 2,000 clients.  Here the k-th free node is found in
a Fenwick tree over the order's positions, and step 2 visits pairs in numpy blocks, taking to
Python only the pairs whose ends were both free at the block's start (a superset of those that
draw, since a full node stays full); once few nodes are still free, only their pairs' turns are
looked up in the permutation.  The draws, and so the graph, are the literal rule's
(tests/test_random_graph.py checks it against the rule written as stated).

Above LITERAL_MAX_NODES nodes step 2 does not order its pairs (2 * 10^6 of them at 2,000 nodes, 5 * 10^11
at 1,000,000), so the graph is drawn with the same law from other draws (`_drawn_tree`,
`_join_drawn_pairs`; tests/test_random_graph.py compares the two laws on small graphs), and is not
the literal rule's graph for its seed.  Step 1 takes its uniform free earlier node from a list.
In step 2, at each turn of the literal rule, every pair not yet visited whose two ends are free
is equally likely to be the next such pair visited, and a pair with a full end draws nothing; so
each turn takes two uniformly drawn free nodes a != b, drawn again where the pair was visited
already (joined, or its draw was 1/2 or more), and joins them when its draw is below 1/2.  Once
few free nodes are left, or their pairs are no more than four times their free degrees left, or
many drawn pairs in a row were visited already, the free nodes' pairs not yet visited are listed
and visited in the order of a drawn permutation of them, a pair with a full end at its turn
drawing nothing: each is then as likely as any other to be the next pair visited with both ends
free, as in the rule.  (Drawing each turn's pair from the list and rebuilding the list after each
join would be quadratic in the pairs: millions of them at a max_degree near N / 2 or above.)
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from fedhop.common.util.rng import numpy_stream

#: the first block of the pairs' permutation visited together; each next block doubles, up to BLOCK_MAX
BLOCK_MIN, BLOCK_MAX = 4096, 1 << 20
#: the most nodes whose step 2 orders all their pairs (the literal rule's draws: 0.1 s at 2,000 nodes, 6 s and
#: 0.9 GB at 10,000); more draw their pairs as they come
LITERAL_MAX_NODES = 2_000
#: free nodes at or below which `_join_drawn_pairs` lists their pairs not yet visited, as it does
#: after LISTED_AFTER_MISSES drawn pairs in a row that were visited already (few pairs are left to visit)
LISTED_FREE, LISTED_AFTER_MISSES = 256, 64
#: ... and as it does once the free nodes' pairs are at most LISTED_PER_SLOT times their free degrees left:
#: a graph that will be dense among its free nodes (max_degree near N / 2 or above) would otherwise draw
#: most of its pairs one by one
LISTED_PER_SLOT = 4
#: the stream's uniform draws taken at once by `_join_drawn_pairs` (the same values drawn one at a time)
DRAW_BLOCK = 4096


class FreeSlots:
    """A Fenwick tree over positions 0..n-1, each 0 or 1: a slot's change and the position of the
    k-th set slot, each in O(log n)."""

    def __init__(self, n: int) -> None:
        self.n, self.tree = n, [0] * (n + 1)
        self.top = 1 << max(n.bit_length() - 1, 0)

    def add(self, position: int, delta: int) -> None:
        i = position + 1
        while i <= self.n:
            self.tree[i] += delta
            i += i & -i

    def kth(self, k: int) -> int:
        """The position of the set slot with k set slots before it."""
        at, step = 0, self.top
        while step:
            nxt = at + step
            if nxt <= self.n and self.tree[nxt] <= k:
                at = nxt
                k -= self.tree[nxt]
            step >>= 1
        return at


class PairIndex:
    """Pairs (a, b), a < b, of n nodes by their index in lexicographic order, with some pairs left
    out of the numbering (`left_out`: their (a, b) arrays)."""

    def __init__(self, n: int, left_out: tuple[np.ndarray, np.ndarray]) -> None:
        self.n = n
        rows = np.arange(n, dtype=np.int64)
        self.row_start = rows * n - rows * (rows + 1) // 2   # the full index of (a, a + 1)
        self.left_out = np.sort(self.full_index(*left_out))
        self._shifted = self.left_out - np.arange(len(self.left_out), dtype=np.int64)
        self.count = n * (n - 1) // 2 - len(self.left_out)

    def full_index(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.row_start[a] + (b - a - 1)

    def numbered(self, full: np.ndarray) -> np.ndarray:
        """The numbering of pairs that are not left out, from their full indices."""
        return full - np.searchsorted(self.left_out, full)

    def pairs(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pairs numbered k."""
        full = k + np.searchsorted(self._shifted, k, side="right")
        m = 2 * self.n - 1   # row a starts at a (2n - 1 - a) / 2: a from the root, then corrected by one where rounding missed
        a = ((m - np.sqrt(float(m) * m - 8.0 * full)) // 2).astype(np.int64)
        np.clip(a, 0, self.n - 2, out=a)
        a -= self.row_start[a] > full
        a += (a < self.n - 2) & (self.row_start[np.minimum(a + 1, self.n - 1)] <= full)
        return a, full - self.row_start[a] + a + 1


def random_graph(num: int, max_degree: int, seed: int, stream: str = "topology/graph") -> list[list[int]]:
    """A seeded connected graph on `num` nodes with every degree <= `max_degree`, as sorted
    adjacency lists (the rule of the module docstring, from stream `stream`)."""
    if num == 1:
        return [[]]
    if max_degree < 2 and num > 2:
        raise ValueError(f"topology.max_degree: got {max_degree}, a connected graph on {num} nodes needs >= 2")
    rng = numpy_stream(seed, stream)
    adj: list[set[int]] = [set() for _ in range(num)]
    degree = [0] * num
    if num > LITERAL_MAX_NODES:
        draws = _Draws(rng)
        _drawn_tree(draws, rng.permutation(num).tolist(), adj, degree, max_degree)
        _join_drawn_pairs(draws, adj, degree, max_degree)
        return [sorted(n) for n in adj]
    _spanning_tree(rng, [int(v) for v in rng.permutation(num)], adj, degree, max_degree)
    index = PairIndex(num, _edges(adj, range(num)))   # the tree's edges left out of the numbering
    order = rng.permutation(index.count)
    free = np.array([d < max_degree for d in degree], dtype=bool)
    _join_pairs(rng, order, index, adj, degree, free, max_degree)
    return [sorted(n) for n in adj]


def _spanning_tree(rng: np.random.Generator, order: list[int], adj: list[set[int]], degree: list[int],
                   max_degree: int) -> None:
    """Step 1: each node of `order` after the first joined to a drawn earlier node with a free degree."""
    position = {v: i for i, v in enumerate(order)}
    slots, free_count = FreeSlots(len(order)), 0
    if max_degree > 0:
        slots.add(0, 1)
        free_count = 1
    for i in range(1, len(order)):
        v, u = order[i], order[slots.kth(int(rng.integers(free_count)))]   # integers(0) raises, as the rule does
        adj[u].add(v)
        adj[v].add(u)
        degree[u] += 1
        degree[v] = 1
        if degree[u] == max_degree:
            slots.add(position[u], -1)
            free_count -= 1
        if degree[v] < max_degree:
            slots.add(i, 1)
            free_count += 1


def _join_pairs(rng: np.random.Generator, order: np.ndarray, index: PairIndex, adj: list[set[int]],
                degree: list[int], free: np.ndarray, max_degree: int) -> None:
    """Step 2 over the pairs numbered in `order`: blocks of it while many nodes are free, then the
    turns of the remaining free nodes' pairs alone."""
    at, block, free_left = 0, BLOCK_MIN, int(free.sum())
    while at < len(order) and free_left >= 2:
        if free_left * (free_left - 1) // 2 * 8 < len(order) - at:
            rest = order[at:]
            a, b = _free_pairs(index, adj, free)
            turn = np.zeros(index.count, dtype=bool)
            turn[index.numbered(index.full_index(a, b))] = True
            a, b = index.pairs(rest[turn[rest]])
            _visit(rng.random, a, b, adj, degree, free, max_degree)
            return
        a, b = index.pairs(order[at:at + block])
        at += block
        block = min(2 * block, BLOCK_MAX)
        hit = free[a] & free[b]
        free_left -= _visit(rng.random, a[hit], b[hit], adj, degree, free, max_degree)


def _free_pairs(index: PairIndex, adj: list[set[int]], free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of free nodes not yet joined (each a < b)."""
    nodes = np.flatnonzero(free)
    i, j = np.triu_indices(len(nodes), 1)
    a, b = nodes[i], nodes[j]
    x, y = _edges(adj, nodes.tolist())
    apart = ~np.isin(index.full_index(a, b), index.full_index(x[free[y]], y[free[y]]))
    return a[apart], b[apart]


def _edges(adj: list[set[int]], nodes: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
    """The edges (a, b), a < b, at the given nodes a."""
    pairs = [(a, b) for a in nodes for b in adj[a] if b > a]
    return (np.array([a for a, _ in pairs], dtype=np.int64).reshape(-1),
            np.array([b for _, b in pairs], dtype=np.int64).reshape(-1))


def _visit(uniform: Callable[[], float], a: np.ndarray, b: np.ndarray, adj: list[set[int]], degree: list[int],
           free: np.ndarray, max_degree: int) -> int:
    """The pairs (a, b) in turn, each drawing `uniform()` when both ends are free at its turn and
    joined when the draw is below 1/2; how many nodes became full."""
    filled = 0
    for x, y in zip(a.tolist(), b.tolist()):
        if degree[x] < max_degree and degree[y] < max_degree and uniform() < 0.5:
            adj[x].add(y)
            adj[y].add(x)
            for node in (x, y):
                degree[node] += 1
                if degree[node] == max_degree:
                    free[node] = False
                    filled += 1
    return filled


def _drawn_tree(draws: "_Draws", order: list[int], adj: list[set[int]], degree: list[int], max_degree: int) -> None:
    """Step 1 with the law of `_spanning_tree` and other draws (above LITERAL_MAX_NODES): node
    order[i] is joined to the k-th, k = floor(u F), of the F earlier nodes with a free degree
    (`_FreeNodes`)."""
    free = _FreeNodes([order[0]])
    for v in order[1:]:
        u = free.drawn(draws)
        adj[u].add(v)
        adj[v].add(u)
        degree[u] += 1
        degree[v] = 1
        if degree[u] == max_degree:
            free.remove(u)
        if degree[v] < max_degree:
            free.add(v)


def _join_drawn_pairs(draws: "_Draws", adj: list[set[int]], degree: list[int], max_degree: int) -> None:
    """Step 2 with its pairs drawn as they come (module docstring, above LITERAL_MAX_NODES).  Every
    choice is from uniform draws u of `random()` (in blocks of DRAW_BLOCK): the k-th of m things
    is k = floor(u m); a pair is joined when its own u is below 1/2.  The free nodes start in
    ascending order (`_FreeNodes`).  The pairs left are then visited as listed (`_visit_listed`)."""
    num = len(adj)
    free = _FreeNodes(v for v in range(num) if degree[v] < max_degree)
    visited: set[int] = set()                # a < b as a * num + b: pairs that drew 1/2 or more

    def fill(v: int) -> None:
        degree[v] += 1
        if degree[v] == max_degree:
            free.remove(v)

    slots = sum(max_degree - degree[v] for v in free.nodes)   # the free degrees left
    misses = 0
    while (len(free) > LISTED_FREE and len(free) * (len(free) - 1) // 2 > LISTED_PER_SLOT * slots
           and misses < LISTED_AFTER_MISSES):
        a, b = free.drawn(draws), free.drawn(draws)
        key = min(a, b) * num + max(a, b)
        if a == b or b in adj[a] or key in visited:
            misses += 1
            continue
        misses = 0
        if draws.uniform() < 0.5:
            adj[a].add(b)
            adj[b].add(a)
            fill(a)
            fill(b)
            slots -= 2
        else:
            visited.add(key)
    _visit_listed(draws, sorted(free.nodes), visited, adj, degree, max_degree)


def _visit_listed(draws: "_Draws", left: list[int], visited: set[int], adj: list[set[int]], degree: list[int],
                  max_degree: int) -> None:
    """The pairs a < b of the free nodes `left` neither joined nor `visited` (keys a * N + b), each
    as likely as any other to be the next one visited: visited in the order of a drawn
    permutation of them (in blocks, as `_join_pairs` does), a pair drawing only where both its ends
    are still free at its turn."""
    num = len(adj)
    nodes = np.array(left, dtype=np.int64)
    i, j = np.triu_indices(len(nodes), 1)
    a, b = nodes[i], nodes[j]
    x, y = _edges(adj, left)
    seen = np.concatenate([x * num + y, np.fromiter(visited, dtype=np.int64, count=len(visited))])
    keep = ~np.isin(a * num + b, seen)
    a, b = a[keep], b[keep]
    free = np.zeros(num, dtype=bool)
    free[nodes] = True
    order = draws.permutation(len(a))
    at, block = 0, BLOCK_MIN
    while at < len(order):
        turns = order[at:at + block]
        at += block
        block = min(2 * block, BLOCK_MAX)
        hit = free[a[turns]] & free[b[turns]]
        _visit(draws.uniform, a[turns][hit], b[turns][hit], adj, degree, free, max_degree)


class _FreeNodes:
    """The nodes with a free degree, in a list: a node added goes last, a node removed has the last
    one take its place."""

    def __init__(self, nodes: Iterable[int]) -> None:
        self.nodes = list(nodes)
        self.place = {v: i for i, v in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def drawn(self, draws: "_Draws") -> int:
        return self.nodes[draws.index(len(self.nodes))]

    def add(self, v: int) -> None:
        self.place[v] = len(self.nodes)
        self.nodes.append(v)

    def remove(self, v: int) -> None:
        last, at = self.nodes.pop(), self.place.pop(v)
        if last != v:
            self.nodes[at] = last
            self.place[last] = at


class _Draws:
    """The stream's `random()` values in order, taken DRAW_BLOCK at a time."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng, self.at = rng, 0
        self.block: list[float] = []

    def uniform(self) -> float:
        if self.at == len(self.block):
            self.block, self.at = self.rng.random(DRAW_BLOCK).tolist(), 0
        self.at += 1
        return self.block[self.at - 1]

    def index(self, m: int) -> int:
        """floor(u m) for the next draw u, at most m - 1."""
        return min(int(self.uniform() * m), m - 1)

    def permutation(self, m: int) -> np.ndarray:
        """A permutation of range(m) drawn from the stream (after the values already taken in a block)."""
        return self.rng.permutation(m)
