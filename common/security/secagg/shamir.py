"""Shamir t-of-n secret sharing (Shamir 1979; SS.share / SS.recon of Bonawitz et al. 2017) of
32-byte secrets over the prime field GF(p), p = 2^31 - 1, vectorised in numpy.

A secret is cut into 3-byte chunks (11 for 32 bytes, the last padded with a zero byte), each a
field element below 2^24 < p.  Each chunk is the constant term of its own random polynomial of
degree t-1; the holder with evaluation point x (x = holder id + 1, never 0) gets the polynomial's
values at x, one 4-byte little-endian field element per chunk (44 bytes for a 32-byte secret).
Reconstruction is Lagrange interpolation at 0 from any t points.  Products of two elements are
below 2^62, so int64 arithmetic is exact.  The coefficients come from the OS's CSPRNG."""
from __future__ import annotations

import os

import numpy as np

from .errors import TOO_FEW_SHARES, SecAggFailure

PRIME = (1 << 31) - 1
CHUNK = 3            # secret bytes per field element
ELEMENT_BYTES = 4    # bytes of one field element on the wire


def elements_of(secret_bytes: int) -> int:
    """Field elements per share of a secret of `secret_bytes` bytes."""
    return -(-secret_bytes // CHUNK)


def share_bytes(secret_bytes: int) -> int:
    """Bytes of one share of a secret of `secret_bytes` bytes."""
    return ELEMENT_BYTES * elements_of(secret_bytes)


def encode_secret(secret: bytes) -> np.ndarray:
    """The secret's field elements (int64), 3 bytes each, little-endian."""
    padded = secret + b"\0" * (elements_of(len(secret)) * CHUNK - len(secret))
    raw = np.frombuffer(padded, dtype=np.uint8).reshape(-1, CHUNK).astype(np.int64)
    return raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)


def decode_secret(elements: np.ndarray, secret_bytes: int) -> bytes:
    if np.any((elements < 0) | (elements >= 1 << (8 * CHUNK))):
        raise SecAggFailure(TOO_FEW_SHARES, "the interpolated elements are not a secret (inconsistent shares)")
    out = np.stack([(elements >> s) & 0xFF for s in (0, 8, 16)], axis=-1).astype(np.uint8)
    return out.tobytes()[:secret_bytes]


def _random_elements(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform elements of GF(p) from the OS's CSPRNG (rejection of the one value 2^31 - 1 = p)."""
    count = int(np.prod(shape))
    out = np.empty(0, dtype=np.int64)
    while out.size < count:
        words = np.frombuffer(os.urandom(4 * (count - out.size + 8)), dtype="<u4").astype(np.int64) & 0x7FFFFFFF
        out = np.concatenate([out, words[words < PRIME]])
    return out[:count].reshape(shape)


def split(secret: bytes, threshold: int, points: list[int]) -> np.ndarray:
    """The shares of `secret` at the evaluation points `points` (each >= 1, distinct): an int64 array
    (len(points), elements).  Any `threshold` of them reconstruct it (Horner over the coefficients)."""
    if threshold < 1 or threshold > len(points):
        raise ValueError(f"threshold {threshold} outside [1, {len(points)}]")
    constant = encode_secret(secret)
    coefficients = _random_elements((threshold - 1, constant.size))           # a_1 .. a_{t-1}
    x = np.asarray(points, dtype=np.int64)[:, None]
    value = np.zeros((x.shape[0], constant.size), dtype=np.int64)
    for row in coefficients[::-1]:
        value = (value + row) % PRIME * x % PRIME
    return (value + constant) % PRIME


def lagrange_at_zero(points: list[int]) -> np.ndarray:
    """The Lagrange coefficients l_i(0) = prod_{j != i} x_j / (x_j - x_i) mod p."""
    out = []
    for i, xi in enumerate(points):
        num, den = 1, 1
        for j, xj in enumerate(points):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        out.append(num * pow(den, PRIME - 2, PRIME) % PRIME)
    return np.asarray(out, dtype=np.int64)


def reconstruct(shares: dict[int, np.ndarray], threshold: int, secret_bytes: int) -> bytes:
    """The secret from {point: share}; fewer than `threshold` shares is a SecAggFailure (too_few_shares),
    never a guess.  The first `threshold` points (in order) are used."""
    if len(shares) < threshold:
        raise SecAggFailure(TOO_FEW_SHARES, f"{len(shares)} shares for a {threshold}-of-n secret")
    points = sorted(shares)[:threshold]
    lam = lagrange_at_zero(points)
    stacked = np.stack([shares[x] for x in points]) % PRIME
    total = np.zeros(stacked.shape[1], dtype=np.int64)
    for coefficient, row in zip(lam, stacked):
        total = (total + int(coefficient) * row) % PRIME
    return decode_secret(total, secret_bytes)


def to_bytes(share: np.ndarray) -> bytes:
    return share.astype("<u4").tobytes()


def from_bytes(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<u4").astype(np.int64)
