"""Secure aggregation, SecAgg+ (Bell et al., CCS 2020), with SecAgg (Bonawitz et al., CCS 2017) as
its complete-graph case: the protocol's parts as a library, and its four rounds as two state
machines (`SecAggClient`, `SecAggServer`) that exchange bytes only.

- `crypto`: X25519 key agreement, HKDF-SHA256, AES-256-GCM and the AES-256-CTR mask PRG, all from
  the `cryptography` package;
- `shamir`: t-of-n secret sharing of 32-byte secrets over GF(2^31 - 1), vectorised in numpy;
- `graph`: the neighbour graph (a Harary graph over a seeded permutation; degree n-1 = complete);
- `quantize`: clipping and stochastic rounding into Z_R and back;
- `masks`: pairwise and self masks, masking and unmasking in Z_R;
- `messages`: the byte layout of every message and the byte formulas per phase;
- `client`, `server`: the rounds; `simulate`: the four rounds in one process with injected dropouts.

docs/secure-aggregation.md describes the protocol as built.  Only numpy and `cryptography` are
imported here (the security layer of docs/architecture.md)."""
from __future__ import annotations

from .errors import SecAggFailure, SecAggRefusal
from .params import SecAggParams

__all__ = ["SecAggFailure", "SecAggRefusal", "SecAggParams"]
