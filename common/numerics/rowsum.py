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
"""
from __future__ import annotations

import bisect
from typing import Sequence

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
