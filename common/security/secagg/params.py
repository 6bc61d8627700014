"""The parameters of one secure-aggregation round and their rules."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .codes import GRID, KINDS, SIGN, IntegerCode


@dataclass(frozen=True)
class SecAggParams:
    """One round's parameters.

    n: the round's clients (ids 0..n-1); degree: neighbours per client k (0 or >= n-1 = the complete
    graph, SecAgg); threshold: t, the shares that reconstruct a secret; modulus_bits: R = 2^bits;
    clip: the L2 norm an update is clipped to (its coordinates then lie in [-clip, clip]);
    quant_bits: each coordinate becomes an integer in [0, 2^quant_bits - 1]; seed: decides the
    graph's permutation and the stochastic rounding (never a key: keys come from the OS); code,
    levels: a compressor's integer code in place of that quantization (codes.py)."""

    n: int
    degree: int
    threshold: int
    modulus_bits: int = 32
    clip: float = 1.0
    quant_bits: int = 16
    seed: int = 0
    code: str = GRID   # the integer code of an update (codes.py): "grid" or "sign"
    levels: int = 0    # a grid code's top level L; 0 = 2^quant_bits - 1

    @property
    def integer_code(self) -> IntegerCode:
        """The clients' code and its shared decoding (codes.py)."""
        if self.code == SIGN:
            return IntegerCode(SIGN, 1, 1.0)
        return IntegerCode(GRID, self.levels or (1 << self.quant_bits) - 1, self.clip)

    @property
    def k(self) -> int:
        """The effective degree: n-1 for the complete graph."""
        return self.n - 1 if self.degree <= 0 or self.degree >= self.n - 1 else self.degree

    @property
    def complete(self) -> bool:
        return self.k == self.n - 1

    @property
    def modulus(self) -> int:
        return 1 << self.modulus_bits

    @property
    def element_bytes(self) -> int:
        """Bytes of one masked coordinate on the wire: ceil(log2 R / 8)."""
        return (self.modulus_bits + 7) // 8

    @property
    def max_dropouts(self) -> int:
        """Dropouts every neighbourhood tolerates: k - t."""
        return self.k - self.threshold

    def problems(self) -> list[str]:
        """What is wrong with these parameters, one line each (empty when they are usable)."""
        out = []
        if self.n < 3:
            out.append(f"secure aggregation needs at least 3 clients in a round, not {self.n}")
        if self.degree < 0:
            out.append(f"degree must be >= 0 (0 = the complete graph), not {self.degree}")
        if not 1 <= self.modulus_bits <= 64:
            out.append(f"modulus_bits must lie in [1, 64], not {self.modulus_bits}")
        if not 1 <= self.quant_bits <= 62:
            out.append(f"quant_bits must lie in [1, 62], not {self.quant_bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            out.append(f"clip must be a positive number, not {self.clip}")
        if self.code not in KINDS or self.levels < 0:
            out.append(f"code must be one of {', '.join(KINDS)} with levels >= 0, not {self.code!r}, {self.levels}")
        if out:
            return out
        k = self.k
        if self.threshold > k:
            out.append(f"threshold {self.threshold} is above the degree {k}: a secret shared among k neighbours "
                       "needs t <= k")
        elif 2 * self.threshold <= k:
            out.append(f"threshold {self.threshold} must be above half the degree {k} (2t > k), so that two "
                       "disjoint groups of neighbours cannot each reconstruct a secret")
        bits = self.integer_code.bits
        need = bits + math.ceil(math.log2(self.n))
        if self.modulus_bits < need:
            out.append(f"modulus_bits {self.modulus_bits} is too small: the sum of {self.n} clients' "
                       f"{bits}-bit values needs {need} bits")
        return out
