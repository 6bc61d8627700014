"""The sum of a long float64 row that is zero but for a few entries, from those entries alone, bit
for bit what `np.sum` gives for the whole row.

A graph's weight matrix (common/topologies/edgeweights.py) sets each diagonal entry to 1 minus the
sum of the row's entries on the graph's edges: W_ii = 1 - sum_{j in N(i)} W_ij.  Written over a
dense N x N matrix that sum is `W[i].sum()`; kept as the row's few entries, the same number needs
the same additions in the same order.  NumPy sums a contiguous float64 array pairwise
(tests/test_graph_weights.py checks this module against the installed numpy): a length below 8
one element after the other; a length up to 128 in eight interleaved running sums (element k goes
to sum k mod 8) combined as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), the elements past
the last multiple of 8 added after; a longer one as the sum of its two halves (the first half's
length rounded down to a multiple of 8).  Adding an exact zero changes no sum of finite numbers
but -0.0, so the sum is that tree over the nonzero entries alone: O(d log N) for d entries of a
row of N, not O(N).

`sparse_row_sums` does it for every row of a matrix at once: where no two of a row's entries fall
in one of the runs numpy sums with its running sums, a row's sum is a tree over its entries in
column order, two neighbouring entries (or the sums holding them) added where the halving first
separates them, the deepest first; the rows of each length are folded together, one addition per
row and step.  The rows with two entries in one run take `sparse_row_sum`.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

BLOCK = 128    # the longest run numpy sums with its eight running sums (PW_BLOCKSIZE)
UNROLL = 8     # its running sums


def sparse_row_sum(length: int, cols: Sequence[int], values: Sequence[float]) -> float:
    """`np.zeros(length)` with `values` at `cols` (ascending, distinct, none -0.0), summed by
    `np.sum`: the same float, bit for bit."""
    return 0.0 + _pairwise(0, length, cols, values, 0, len(cols))


def _pairwise(start: int, length: int, cols: Sequence[int], values: Sequence[float], lo: int, hi: int) -> float:
    """The sum of elements start..start+length-1, whose nonzeros are cols[lo:hi]."""
    if lo == hi:
        return 0.0
    if length < UNROLL:
        total = 0.0
        for k in range(lo, hi):
            total += values[k]
        return total
    if length <= BLOCK:
        body = start + length - length % UNROLL   # the part summed in the eight running sums
        s = [0.0] * UNROLL
        k = lo
        while k < hi and cols[k] < body:
            s[(cols[k] - start) % UNROLL] += values[k]
            k += 1
        total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
        while k < hi:
            total += values[k]
            k += 1
        return total
    half = length // 2
    half -= half % UNROLL
    mid = bisect.bisect_left(cols, start + half, lo, hi)
    return (_pairwise(start, half, cols, values, lo, mid)
            + _pairwise(start + half, length - half, cols, values, mid, hi))


def sparse_row_sums(length: int, starts: np.ndarray, cols: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`sparse_row_sum` of every row of a matrix whose rows have `length` elements: row i's entries
    are `values[starts[i]:starts[i + 1]]` at the columns `cols[...]` (ascending, distinct, none
    -0.0).  Returns float64, one per row."""
    counts = np.diff(starts)
    sums = np.zeros(len(counts))
    short = np.flatnonzero((counts == 1) | (counts == 2))   # one or two entries: the same float in any order
    sums[short] = values[starts[short]]
    two = short[counts[short] == 2]
    sums[two] = sums[two] + values[starts[two] + 1]
    longer = np.flatnonzero(counts > 2)
    pair_rows = np.repeat(longer, counts[longer] - 1)                      # each neighbouring pair's row
    first = starts[pair_rows] + _ranks(counts[longer] - 1)                 # and its first entry
    depth = _split_depths(length, cols[first], cols[first + 1])
    shared = np.zeros(len(counts), dtype=bool)
    shared[pair_rows[depth < 0]] = True
    for i in np.flatnonzero(shared).tolist():
        s, e = int(starts[i]), int(starts[i + 1])
        sums[i] = sparse_row_sum(length, cols[s:e].tolist(), values[s:e].tolist())
    pair_start = np.zeros(len(counts), dtype=np.int64)                     # a row's first pair in `depth`
    pair_start[longer] = np.cumsum(counts[longer] - 1) - (counts[longer] - 1)
    for k in np.unique(counts[longer]).tolist():
        rows = longer[(counts[longer] == k) & ~shared[longer]]
        if rows.size:
            entries = values[starts[rows][:, None] + np.arange(k)]
            gaps = depth[pair_start[rows][:, None] + np.arange(k - 1)]
            sums[rows] = _fold(entries, gaps)
    return sums


def _ranks(sizes: np.ndarray) -> np.ndarray:
    """0, 1, ..., size - 1 for each of `sizes`, concatenated."""
    ends = np.cumsum(sizes)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - sizes, sizes)


def _split_depths(length: int, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """For columns low < high of a row of `length`: the depth of the halving (`_pairwise`) that
    first puts them in different halves, or -1 where they end in one run summed with the running
    sums (length <= BLOCK)."""
    depth = np.full(len(low), -1, dtype=np.int64)
    start = np.zeros(len(low), dtype=np.int64)
    size = np.full(len(low), length, dtype=np.int64)
    open_ = np.flatnonzero(size > BLOCK)
    level = 0
    while open_.size:
        half = size[open_] // 2
        half -= half % UNROLL
        mid = start[open_] + half
        in_low, in_high = high[open_] < mid, low[open_] >= mid
        depth[open_[~in_low & ~in_high]] = level
        size[open_[in_low]] = half[in_low]
        start[open_[in_high]] = mid[in_high]
        size[open_[in_high]] -= half[in_high]
        open_ = open_[(in_low | in_high) & (size[open_] > BLOCK)]
        level += 1
    return depth


def _fold(entries: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Each row of `entries` (m x k) summed as the halving's tree: the neighbouring pair separated
    deepest (`gaps`, m x (k - 1)) added first, its sum taking the pair's place, until one is left."""
    m = len(entries)
    row = np.arange(m)
    while entries.shape[1] > 1:
        j = np.argmax(gaps, axis=1)
        entries[row, j] = entries[row, j] + entries[row, j + 1]
        keep = np.ones(entries.shape, dtype=bool)
        keep[row, j + 1] = False
        entries = entries[keep].reshape(m, -1)
        keep_gaps = np.ones(gaps.shape, dtype=bool)
        keep_gaps[row, j] = False
        gaps = gaps[keep_gaps].reshape(m, -1)
    return 0.0 + entries[:, 0]
