"""The integer code of a client's update in SecAgg+'s field, and the decoding of a sum of codes.

SecAgg+ sums integers mod R, so what it can aggregate of a compressor is an integer code whose
decoding is the same affine map for every client, value = code * 2 scale / top - scale: then the
decoded sum of m clients is

    sum_i decode(c_i) = (sum_i c_i) * 2 scale / top - m scale                          (linear)

and the server needs only the unmasked sum of the codes.  A code whose scale is the client's own
(QSGD's per-client norm, the scaled sign's ||v||_1 / d, stochastic rounding between the client's
own min and max, natural compression's exponents) has no such map: the sum of the codes does not
determine the sum of the values.  The codes built (docs/secure-aggregation.md, "Compressors"):

- `grid`: stochastic rounding onto top + 1 evenly spaced points of [-scale, scale], scale =
  secure_aggregation.clip, after the L2 clip to it (quantize.py).  SecAgg+'s own code (top =
  2^quant_bits - 1), `compression.up = "rounding"` with its range shared instead of per client
  (top = 2^bits - 1), and `compression.up = "qsgd"` with the shared norm scale clip: QSGD's code
  (sign, level l in 0..s) of v / clip is sign * l, shifted by s into [0, 2s] (top = 2s), and
  QSGD's unbiased rounding between the levels l / s and (l + 1) / s of |v_j| / clip is the grid's
  rounding between neighbouring points;
- `sign`: signSGD's code 1[v_j >= 0] (sign(0) = +, as fedhop's `sign` compressor), top = 1,
  scale = 1: decode(c) = 2c - 1 = +-1, the compressor's own decoding; the sum of the codes gives
  the sum of the signs (2 S - m), and so the majority vote, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import quantize

GRID = "grid"
SIGN = "sign"
KINDS = (GRID, SIGN)


@dataclass(frozen=True)
class IntegerCode:
    """A code in [0, top] per coordinate with the shared decoding c * 2 scale / top - scale."""

    kind: str
    top: int
    scale: float

    @property
    def bits(self) -> int:
        """Bits of one code: the smallest b with 2^b > top."""
        return self.top.bit_length()

    @property
    def step(self) -> float:
        """The distance between neighbouring decoded values, 2 scale / top: the most stochastic
        rounding moves a coordinate (0 for `sign`, which does not round: it keeps only the sign)."""
        return 2 * self.scale / self.top if self.kind == GRID else 0.0

    def encode(self, update: np.ndarray, rng: np.random.Generator, bound: float | None = None) -> np.ndarray:
        """The update's codes (uint64).  `bound`: the L2 clip before a grid code (at most scale)."""
        x = np.asarray(update, dtype=np.float64)
        if self.kind == SIGN:
            return (x >= 0).astype(np.uint64)
        return quantize.quantize(x, self.scale, 0, rng, bound, top=self.top)

    def decode_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The float sum of `count` clients' decoded values from the integer sum of their codes."""
        return total.astype(np.float64) * (2 * self.scale / self.top) - count * self.scale
