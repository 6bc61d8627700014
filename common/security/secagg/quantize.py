"""Clipping, quantization into Z_R and back.

An update x is clipped to L2 norm `clip` (x * min(1, clip / ||x||)), so each coordinate lies in
[-clip, clip].  With L = 2^quant_bits - 1 levels, a coordinate maps to y = (x + clip) / (2 clip) * L
in [0, L] and is rounded stochastically: floor(y) + 1 with probability y - floor(y), else floor(y)
(unbiased: E[round(y)] = y), the uniforms drawn from numpy's PCG64 seeded with
(seed, round, the client's protocol id, 0x9A) so a run is reproducible.  The quantized value q lies in [0, L] and
the sum of n of them in [0, n L] < R when modulus_bits >= quant_bits + ceil(log2 n)
(SecAggParams.problems), so the sum mod R is the integer sum.

Dequantizing a sum S of m clients' values: S * 2 clip / L - m clip.  Each client's error per
coordinate is below one step 2 clip / L, so the dequantized sum is within m * 2 clip / L of the sum
of the clipped updates, coordinate by coordinate.

Under differential privacy (docs/privacy.md, "with secure aggregation") the update is clipped to a
tighter L2 bound first, `private_bound`: B = min(C - sqrt(d) * 2 clip / L, clip), so that whatever
the rounding draws, the dequantized update q * 2 clip / L - clip (each coordinate within one step
of x) has L2 norm at most ||x|| + sqrt(d) * 2 clip / L <= C: the sum the server noises has
sensitivity C, the bound the noise is scaled to."""
from __future__ import annotations

import numpy as np


def clip_update(update: np.ndarray, clip: float) -> np.ndarray:
    norm = float(np.linalg.norm(update))
    return update * (clip / norm) if norm > clip else update


def levels(quant_bits: int) -> int:
    return (1 << quant_bits) - 1


def quantize(update: np.ndarray, clip: float, quant_bits: int, rng: np.random.Generator,
             bound: float | None = None, top: int | None = None) -> np.ndarray:
    """The update clipped to L2 norm `bound` (default and at most `clip`), as integers in
    [0, L] (uint64) over the range [-clip, clip], by stochastic rounding; L = `top`, else
    2^quant_bits - 1."""
    top = top if top is not None else levels(quant_bits)
    norm_bound = clip if bound is None else min(bound, clip)
    x = np.clip(clip_update(np.asarray(update, dtype=np.float64), norm_bound), -clip, clip)
    y = (x + clip) / (2 * clip) * top
    low = np.floor(y)
    q = low + (rng.random(y.shape) < (y - low))
    return np.minimum(q, top).astype(np.uint64)


def private_bound(dp_clip: float, d: int, clip: float, step: float) -> float:
    """B = min(C - sqrt(d) * step, clip), step = 2 clip / L: the L2 bound an update of d coordinates
    is clipped to before quantization so that its dequantized value has norm at most C (module
    docstring); <= 0 where rounding alone could move it by C (too few levels for d)."""
    return min(dp_clip - float(np.sqrt(d)) * step, clip)


def dequantize_sum(total: np.ndarray, count: int, clip: float, quant_bits: int) -> np.ndarray:
    """The float sum of `count` clients' updates from the integer sum of their quantized values."""
    return total.astype(np.float64) * (2 * clip / levels(quant_bits)) - count * clip


def rounding_rng(seed: int, round_number: int, client: int) -> np.random.Generator:
    return np.random.default_rng([seed, round_number, client, 0x9A])
