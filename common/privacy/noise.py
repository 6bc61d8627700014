"""Gaussian noise for the private mechanisms, from one of two sources (`privacy.secure_noise`):

- seeded (the default): numpy's PCG64 stream named ("privacy", ...) under the run seed
  (common/util/rng.py), so a research run is reproducible bit for bit;
- secure: the operating system's cryptographically secure generator (`os.urandom`), turned into
  standard normal draws by the Box-Muller transform in float64 (53-bit uniforms).  Nobody can
  predict or replay it, the seed included.  The transform is the textbook one; the floating-point
  caveats of sampling continuous noise (Mironov, CCS 2012) apply to both sources alike
  (docs/privacy.md).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from fedhop.common.util.rng import numpy_stream

_TWO_53 = float(1 << 53)


def secure_standard_normal(n: int) -> np.ndarray:
    """n independent N(0, 1) draws from os.urandom: Box-Muller on pairs of uniforms in (0, 1]."""
    pairs = (n + 1) // 2
    raw = np.frombuffer(os.urandom(16 * pairs), dtype="<u8").reshape(2, pairs)
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) / _TWO_53    # (0, 1]: log never sees 0
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) / _TWO_53            # [0, 1)
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2.0 * math.pi * u2), r * np.sin(2.0 * math.pi * u2)])
    return z[:n]


class GaussianSource:
    """Standard normal draws for one use (a round's aggregate, one client's update): from the
    seeded stream `names` under `seed`, or from os.urandom when `secure`."""

    def __init__(self, secure: bool, seed: int, *names: str | int) -> None:
        self.secure = secure
        self._rng = None if secure else numpy_stream(seed, "privacy", *names)

    def standard_normal(self, n: int) -> np.ndarray:
        if self.secure:
            return secure_standard_normal(n)
        assert self._rng is not None
        return self._rng.standard_normal(n)

    def like(self, t: torch.Tensor, std: float) -> torch.Tensor:
        """N(0, std^2) noise of `t`'s shape and dtype (drawn in float64)."""
        draw = self.standard_normal(t.numel()).reshape(tuple(t.shape)) * std
        return torch.from_numpy(draw).to(dtype=t.dtype, device=t.device)

    def scalar(self, std: float) -> float:
        return float(self.standard_normal(1)[0]) * std


def add_noise(tensors: dict[str, torch.Tensor], std: float, source: GaussianSource,
              names: list[str]) -> dict[str, torch.Tensor]:
    """`tensors` with N(0, std^2) added to every element of the named tensors, in name order."""
    out = dict(tensors)
    if std <= 0:
        return out
    for name in names:
        out[name] = tensors[name] + source.like(tensors[name], std)
    return out
