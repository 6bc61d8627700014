"""QSGD (Alistarh et al., NeurIPS 2017) as a member of the compressor family: the quantizer,
its packing and its bytes are common/processors/compress.py's (4 bytes per bucket norm +
ceil(d (1 + ceil(log2(s + 1))) / 8) bytes of codes), here behind the `Compressor` interface."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping

import torch

from fedhop.common.processors import compress as q
from fedhop.common.processors.compressors.base import Parts, expect
from fedhop.common.wire.codec import PayloadError


@dataclass(frozen=True)
class QSGD:
    """QSGD: an unbiased s-level stochastic quantizer with one float32 norm per bucket.

    Keys: `levels` (s, the levels per sign), `bucket` (B: a norm per B elements; 0 = one norm for
    the whole tensor).  Parts "norm" (float32, 0-dim or [ceil(d / B)]) and "codes" (uint8, the
    b-bit codes packed MSB-first, b = 1 + ceil(log2(s + 1)))."""

    name: ClassVar[str] = "qsgd"
    unbiased: ClassVar[bool] = True
    levels: int = field(default=15, metadata={"min": 1, "max": 1 << 20, "help": "QSGD s (levels per sign)"})
    bucket: int = field(default=0, metadata={"min": 0, "help": "QSGD bucket size B (a norm per B elements); 0 = "
                                                                "the whole tensor"})

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        norm, negative, level = q.quantize(v, self.levels, rng, self.bucket)
        return {"norm": norm, "codes": q.pack_codes(negative, level, self.levels)}

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        want = () if self.bucket <= 0 else (q.num_buckets(numel, self.bucket),)
        norm = expect(parts, "norm", torch.float32, want, "QSGD")
        if not bool(torch.isfinite(norm).all()) or bool((norm < 0).any()):
            raise PayloadError("NON_FINITE", "QSGD norm is not finite and >= 0")
        codes = expect(parts, "codes", torch.uint8, ((numel * q.bits_per_element(self.levels) + 7) // 8,), "QSGD")
        negative, level = q.unpack_codes(codes, numel, self.levels)
        return q.dequantize(norm, negative, level, self.levels, self.bucket)

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return q.encoded_bytes(numel, self.levels, self.bucket)


REGISTER = [QSGD]   # a built-in compressor (compressors/__init__.py)
