"""Masking in Z_R, R = 2^bits (Bonawitz et al. 2017, round 2 MaskedInputCollection):

    y_u = x_u + PRG(b_u) + sum_{v in N(u) cap U2} sign(u, v) PRG(s_{u,v})      (mod R)

with sign(u, v) = +1 when u < v and -1 when u > v, so the pair's two masks cancel in the sum.  The
server's unmasking (round 4):

    z = sum_{u in U3} y_u - sum_{u in U3} PRG(b_u) - sum_{u in U2 \\ U3} sum_{v in N(u) cap U3} sign(v, u) PRG(s_{v,u})

(the pairwise masks that survivors v added for a dropped u).  All values are uint64; arithmetic
wraps mod 2^64 and R divides 2^64, so one final reduction mod R is exact."""
from __future__ import annotations

import numpy as np

from . import crypto


def sign(u: int, v: int) -> int:
    return 1 if u < v else -1


def add_signed(total: np.ndarray, mask: np.ndarray, s: int) -> np.ndarray:
    """total + s * mask mod 2^64 (uint64 wraps; subtraction is addition of the two's complement)."""
    return total + mask if s > 0 else total - mask


def pairwise_mask(seed: bytes, d: int, bits: int) -> np.ndarray:
    return crypto.prg_mod(seed, d, bits)


def mask_input(quantized: np.ndarray, self_seed: bytes, pair_seeds: dict[int, bytes], me: int,
               bits: int) -> np.ndarray:
    """y_u: the quantized update plus the self mask and the signed pairwise masks, mod R."""
    d = quantized.shape[0]
    with np.errstate(over="ignore"):
        y = quantized.astype(np.uint64) + crypto.prg_mod(self_seed, d, bits)
        for v, seed in pair_seeds.items():
            y = add_signed(y, pairwise_mask(seed, d, bits), sign(me, v))
    return y & crypto.modulus_mask(bits)


def unmask(masked: dict[int, np.ndarray], self_seeds: dict[int, bytes],
           dropped_pairs: list[tuple[int, int, bytes]], d: int, bits: int) -> np.ndarray:
    """z: the sum of the survivors' masked inputs less their self masks and less the pairwise masks
    (v, u, s_{v,u}) that survivor v added for dropped u; the integer sum mod R."""
    total = np.zeros(d, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for y in masked.values():
            total = total + y
        for u in masked:
            total = total - crypto.prg_mod(self_seeds[u], d, bits)
        for v, u, seed in dropped_pairs:
            total = add_signed(total, pairwise_mask(seed, d, bits), -sign(v, u))
    return total & crypto.modulus_mask(bits)
