"""The neighbour graph of SecAgg+ (Bell et al. 2020, the random Harary graph).

The Harary graph H(k, n) on positions 0..n-1 joins every position i to i +- 1, ..., i +- floor(k/2)
(mod n); for odd k it adds the chords i -- i + floor(n/2): a perfect matching for even n (every
degree k), and for odd n the chords from i = 0..(n-1)/2 (Harary's construction: one position gets
degree k+1).  Clients are placed on the positions by a permutation drawn from the round's seed, so
who neighbours whom is random but reproducible.  Degree n-1 is the complete graph: SecAgg
(Bonawitz et al. 2017), where every client shares with all others."""
from __future__ import annotations

import numpy as np


def harary_edges(n: int, k: int) -> set[tuple[int, int]]:
    """The edges (a < b) of H(k, n) over positions 0..n-1; k >= n-1 gives the complete graph."""
    if k >= n - 1:
        return {(a, b) for a in range(n) for b in range(a + 1, n)}
    edges: set[tuple[int, int]] = set()
    for i in range(n):
        for step in range(1, k // 2 + 1):
            j = (i + step) % n
            edges.add((min(i, j), max(i, j)))
    if k % 2:
        chords = range(n // 2) if n % 2 == 0 else range((n + 1) // 2)
        for i in chords:
            j = (i + n // 2) % n
            if i != j:
                edges.add((min(i, j), max(i, j)))
    return edges


def neighbours(n: int, k: int, seed: int, round_number: int = 0) -> dict[int, frozenset[int]]:
    """Client id -> its neighbours: H(k, n) with client `perm[i]` at position i, perm from the seed."""
    perm = np.random.default_rng([seed, round_number, 0x5EC]).permutation(n)
    out: dict[int, set[int]] = {u: set() for u in range(n)}
    for a, b in harary_edges(n, k):
        u, v = int(perm[a]), int(perm[b])
        out[u].add(v)
        out[v].add(u)
    return {u: frozenset(vs) for u, vs in out.items()}
