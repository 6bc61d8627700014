"""What a compressor is: the interface every member of the family implements (built-in or a
user's plug-in), and the checks its decoder uses on what a participant sent.

A compressor codes ONE flattened float32 tensor v (d >= 1 elements) into named parts, plain
tensors that travel as they are (each part's bytes are its tensor's bytes: the ledger counts
them with no other cost), and decodes those parts back into float32[d]:

    parts = compressor.encode(v, rng)            # {"idx": uint8[...], "val": float16[k], ...}
    v_hat = compressor.decode(parts, d)          # float32[d]
    compressor.encoded_bytes(d, parts) == sum(p.numel() * p.element_size() for p in parts.values())

`encoded_bytes` states the byte formula of the compressor's documentation (a function of d and,
for a data-dependent size such as a threshold's, of what the parts say, e.g. how many were kept);
the tests and docs/compression.md compare it with the ledger's bytes.  On the wire a part `P` of
tensor `NAME` is the tensor `"{compressor.name}.{P}:{NAME}"` (common/processors/compressors/payload.py).

`decode` runs on a participant's input: a part of the wrong dtype, shape or range raises
`PayloadError` (via `expect`), never another exception, and never reads out of bounds.
`unbiased` says E[decode(encode(v))] = v over the draws of `rng` (random-k, stochastic rounding,
natural compression, QSGD); a biased one (top-k, sign) is what error feedback wraps
(common/processors/compressors/feedback.py).
"""
from __future__ import annotations

from typing import ClassVar, Mapping, Protocol, runtime_checkable

import torch

from fedhop.common.wire.codec import PayloadError

Parts = dict[str, torch.Tensor]


@runtime_checkable
class Compressor(Protocol):
    """One compressor (module docstring).  `name` is the wire prefix of its parts: lower-case
    letters, digits and '_' (e.g. "topk")."""

    name: ClassVar[str]
    unbiased: ClassVar[bool]

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        """The parts of float32[d] `v` (d >= 1); draws only from `rng` (seeded by the caller)."""
        ...

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        """float32[numel] from `parts`; PayloadError for anything malformed."""
        ...

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        """The documented byte formula of the parts of a d = `numel` tensor."""
        ...


def expect(parts: Mapping[str, torch.Tensor], part: str, dtype: torch.dtype, shape: tuple[int, ...],
           what: str) -> torch.Tensor:
    """`parts[part]`, checked to be a `dtype` tensor of `shape` (PayloadError BAD_NAME / BAD_SHAPE
    naming `what` otherwise); on the CPU, contiguous."""
    t = parts.get(part)
    if t is None:
        raise PayloadError("BAD_NAME", f"{what}: part '{part}' is missing")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise PayloadError("BAD_SHAPE", f"{what}: part '{part}' must be {dtype}{list(shape)}, "
                                        f"got {t.dtype}{list(t.shape)}")
    return t.detach().cpu().contiguous()


def expect_1d(parts: Mapping[str, torch.Tensor], part: str, dtype: torch.dtype, what: str,
              max_len: int) -> torch.Tensor:
    """`parts[part]` as a 1-D `dtype` tensor of at most `max_len` elements (a length the sender
    chose, such as a threshold's count of kept values)."""
    t = parts.get(part)
    if t is None:
        raise PayloadError("BAD_NAME", f"{what}: part '{part}' is missing")
    if t.dtype != dtype or t.dim() != 1 or t.numel() > max_len:
        raise PayloadError("BAD_SHAPE", f"{what}: part '{part}' must be {dtype}[<= {max_len}], "
                                        f"got {t.dtype}{list(t.shape)}")
    return t.detach().cpu().contiguous()


def nbytes(parts: Mapping[str, torch.Tensor]) -> int:
    """The bytes the parts' tensors hold (what the ledger's tensor bytes count)."""
    return sum(t.numel() * t.element_size() for t in parts.values())
