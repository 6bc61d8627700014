"""Quantizing compressors (issue 47): sign, scaled sign, b-bit stochastic rounding, natural
compression and the float16 / bfloat16 casts.

Each codes one flattened float32[d] tensor v (d >= 1) into parts (common/processors/compressors/base.py):

| name          | class                | unbiased | parts                                          | bytes                  |
|---------------|----------------------|----------|------------------------------------------------|------------------------|
| `sign`        | `Sign`               | no       | bits uint8[ceil(d/8)]                          | ceil(d / 8)            |
| `scaled_sign` | `ScaledSign`         | no       | scale float32[], bits uint8[ceil(d/8)]         | 4 + ceil(d / 8)        |
| `rounding`    | `StochasticRounding` | yes      | lo, hi float32[], codes uint8[ceil(d b/8)]     | 8 + ceil(d b / 8)      |
| `natural`     | `Natural`            | yes      | codes uint8[ceil(9 d/8)]                       | ceil(9 d / 8)          |
| `fp16`        | `Float16`            | no       | v float16[d]                                   | 2 d                    |
| `bf16`        | `BFloat16`           | no       | v bfloat16[d]                                  | 2 d                    |

Bit packing is numpy's (`np.packbits` / `np.unpackbits`, MSB-first, as common/processors/compress.py
packs QSGD's codes): a code of b bits puts its most significant bit first, codes follow each other
with no gap, and the last byte is padded with zero bits.  A decoder rejects non-zero padding, so
every vector has exactly one encoding.

`encode` takes a non-empty 1-D float32 tensor (anything else is the caller's bug: ValueError).
A non-finite v_i (a diverged client) is sent so that the receiver rejects it (PayloadError
NON_FINITE), as the sparse compressors do: a non-finite scale, lo or hi, natural's exponent code
255, a non-finite float16/bfloat16 value.  Only `Sign` cannot carry one: a NaN has no sign
(ValueError at encode), +-Inf are signs like any other.  `decode` takes what a participant sent
and raises `PayloadError` for any malformed part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

import numpy as np
import torch

from fedhop.common.processors.compressors.base import Parts, expect
from fedhop.common.wire.codec import PayloadError

_EXP_ZERO = 0        # Natural: the exponent code of 0 (float32's biased exponent of zero and subnormals)
_EXP_MAX = 254       # Natural: the largest exponent code, 2^127 (255, float32's Inf/NaN, marks a non-finite v_i)


# ----------------------------------------------------------------------------- shared helpers
def _input(v: torch.Tensor, what: str) -> torch.Tensor:
    """`v` checked to be a non-empty, 1-D float32 tensor; on the CPU, contiguous."""
    if v.dtype != torch.float32 or v.dim() != 1 or v.numel() < 1:
        raise ValueError(f"{what}: encode takes a non-empty 1-D float32 tensor, got {v.dtype}{list(v.shape)}")
    return v.detach().cpu().contiguous()


def packed_len(numel: int, bits: int) -> int:
    """Bytes of `numel` codes of `bits` bits each, packed: ceil(numel * bits / 8)."""
    return (numel * bits + 7) // 8


def pack(codes: np.ndarray, bits: int) -> torch.Tensor:
    """uint8[ceil(d b / 8)]: the d codes (each in [0, 2^b)), b bits each, MSB-first, zero-padded."""
    codes = np.asarray(codes, dtype=np.uint32)
    planes = np.empty((codes.size, bits), dtype=np.uint8)
    for j in range(bits):                      # bit plane j holds bit (b - 1 - j) of every code
        planes[:, j] = (codes >> np.uint32(bits - 1 - j)) & np.uint32(1)
    return torch.from_numpy(np.packbits(planes.reshape(-1)))


def unpack(packed: torch.Tensor, numel: int, bits: int, what: str) -> np.ndarray:
    """The `numel` codes (uint32) of `pack`'s output; PayloadError when a padding bit is set
    (`packed` has already been checked to be uint8[ceil(numel * bits / 8)])."""
    flat = np.unpackbits(packed.numpy())
    if flat[numel * bits:].any():
        raise PayloadError("BAD_SHAPE", f"{what}: the padding bits after {numel} codes of {bits} bits are not zero")
    planes = flat[:numel * bits].reshape(numel, bits)
    codes = np.zeros(numel, dtype=np.uint32)
    for j in range(bits):
        codes |= planes[:, j].astype(np.uint32) << np.uint32(bits - 1 - j)
    return codes


def _scalar(parts: Mapping[str, torch.Tensor], part: str, what: str) -> float:
    """A finite float32 0-dim part, as a Python float (exact: float32 -> float64)."""
    t = expect(parts, part, torch.float32, (), what)
    if not bool(torch.isfinite(t)):
        raise PayloadError("NON_FINITE", f"{what}: part '{part}' is {float(t)}, not finite")
    return float(t)


def _sign_bits(flat: torch.Tensor) -> torch.Tensor:
    """uint8[ceil(d/8)]: bit i set where v_i < 0 (sign(0) = +1, also for -0.0)."""
    return torch.from_numpy(np.packbits((flat < 0).numpy()))


def _signs(parts: Mapping[str, torch.Tensor], numel: int, what: str) -> np.ndarray:
    """float32[numel] of +-1.0 from the 'bits' part (bit set = -1)."""
    bits = expect(parts, "bits", torch.uint8, (packed_len(numel, 1),), what)
    negative = unpack(bits, numel, 1, what)
    return (1.0 - 2.0 * negative.astype(np.float32)).astype(np.float32)


# ----------------------------------------------------------------------------- sign
@dataclass(frozen=True)
class Sign:
    """signSGD's compressor (Bernstein et al., ICML 2018, "signSGD: compressed optimisation for
    non-convex problems", Algorithm 1: x_{k+1} = x_k - delta * sign(g_k)): C(v)_i = sign(v_i) in
    {-1, +1}, with sign(0) = +1 (the paper leaves sign(0) open; here 0 and -0.0 are +1).

    Wire: part `bits`, uint8[ceil(d/8)], bit i (MSB-first) set where v_i < 0; decode gives +-1.0
    float32.  Bytes: ceil(d / 8).  Biased (the magnitude is dropped): what error feedback wraps.
    A NaN has no sign and no bit to carry it: encode refuses it (ValueError); +-Inf are +-1.
    Majority vote over the clients' signs is an aggregation rule, not part of this compressor.
    No keys.
    """

    name: ClassVar[str] = "sign"
    unbiased: ClassVar[bool] = False

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        flat = _input(v, self.name)
        if bool(torch.isnan(flat).any()):
            raise ValueError(f"{self.name}: encode got NaN, which has no sign")
        return {"bits": _sign_bits(flat)}

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return torch.from_numpy(_signs(parts, numel, f"{self.name} decode"))

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return packed_len(numel, 1)


@dataclass(frozen=True)
class ScaledSign:
    """Scaled sign (Karimireddy et al., ICML 2019, "Error feedback fixes SignSGD and other gradient
    compression schemes", Algorithm 1 EF-SIGNSGD, the line Delta_t = (||p_t||_1 / d) sign(p_t)):

        C(v) = (||v||_1 / d) * sign(v),   sign(0) = +1.

    scale = ||v||_1 / d is summed in float64 and rounded once to float32 (so it does not depend on
    the order of the summation beyond float64's rounding); scale <= max |v_i|, so it is finite for a
    finite v (a non-finite v gives a non-finite scale, which the receiver rejects).

    Wire: part `scale`, float32 0-dim (4 bytes), and part `bits` as `Sign`'s.  Bytes: 4 + ceil(d / 8).
    Decode: scale * (+-1) in float32 (exact).  A negative or non-finite scale is malformed.
    Biased (||C(v) - v|| is not zero in expectation); Karimireddy et al. pair it with error feedback.
    No keys.
    """

    name: ClassVar[str] = "scaled_sign"
    unbiased: ClassVar[bool] = False

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        flat = _input(v, self.name)
        scale = (flat.to(torch.float64).abs().sum() / flat.numel()).to(torch.float32)
        return {"scale": scale.reshape(()), "bits": _sign_bits(flat)}

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        what = f"{self.name} decode"
        scale = _scalar(parts, "scale", what)
        if scale < 0:
            raise PayloadError("BAD_SHAPE", f"{what}: scale {scale} is negative (||v||_1 / d >= 0)")
        return torch.from_numpy(_signs(parts, numel, what) * np.float32(scale))

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return 4 + packed_len(numel, 1)


# ----------------------------------------------------------------------------- stochastic rounding
@dataclass(frozen=True)
class StochasticRounding:
    """b-bit stochastic uniform quantization between the tensor's min and max: Suresh et al., ICML
    2017, "Distributed mean estimation with limited communication", Sec. 2.2 "stochastic k-level
    quantization" pi_sk with k = 2^b levels (Sec. 2.1's stochastic binary quantization is k = 2,
    b = 1).  Their levels are B(r) = X^min + r (X^max - X^min) / (k - 1), r = 0..k-1, and a
    coordinate in [B(r), B(r+1)) goes to B(r+1) with probability (X(j) - B(r)) / (B(r+1) - B(r)),
    else to B(r); so E[Y(j)] = X(j), and the variance of a coordinate is at most
    (X^max - X^min)^2 / (4 (k - 1)^2) (the per-coordinate step behind their Theorem 2).  Section
    and theorem numbers are as recalled from the ICML version; no copy of the paper was at hand
    to check them or to give equation numbers, so the formulas below state what is implemented.

    Here, with lo = min v, hi = max v, L = 2^b - 1 and step = (hi - lo) / L (float64 arithmetic):

        x_i = (v_i - lo) / (hi - lo) * L,   code_i = floor(x_i) + [u_i < x_i - floor(x_i)],
        decode_i = lo + code_i * step   (rounded to float32, clamped to [lo, hi]),

    u = torch.rand(d, generator=rng) (float32; d draws on every call, also when hi == lo).
    Var(decode_i) = f (1 - f) step^2 <= step^2 / 4, f = frac(x_i).  Bias: float32 u takes the
    values j / 2^24, so P(round up) = ceil(f 2^24) / 2^24, within 2^-24 of f: |E - v_i| <= 2^-24 step,
    plus the float32 rounding of the decoded level (half an ulp of it).  hi == lo (d = 1, a constant
    tensor): every code is 0 and decode gives lo (a non-zero code is then malformed).  A non-finite
    v_i makes lo or hi non-finite (codes all 0), which the receiver rejects.

    Wire: parts `lo`, `hi` float32 0-dim, `codes` uint8[ceil(d b / 8)], b bits per code MSB-first.
    Bytes: 8 + ceil(d b / 8).  Malformed: a non-finite lo or hi, lo > hi, wrong dtypes or shapes,
    non-zero padding bits.

    Keys: `bits` (b, 1..16, default 8): bits per coordinate.
    """

    name: ClassVar[str] = "rounding"
    unbiased: ClassVar[bool] = True

    bits: int = field(default=8, metadata={"min": 1, "max": 16,
                                           "help": "bits per coordinate b: 2^b levels between the tensor's min and max"})

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
            raise ValueError(f"{self.name}.bits: got {self.bits!r}, must be an integer in [1, 16]")

    @property
    def levels(self) -> int:
        """L = 2^b - 1, the largest code."""
        return (1 << self.bits) - 1

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        flat = _input(v, self.name)
        u = torch.rand(flat.numel(), generator=rng).numpy().astype(np.float64)
        x64 = flat.numpy().astype(np.float64)
        lo, hi = float(x64.min()), float(x64.max())          # float32 values, exact in float64; NaN propagates
        if math.isfinite(lo) and math.isfinite(hi) and hi > lo:
            x = (x64 - lo) / (hi - lo) * self.levels
            low = np.floor(x)
            codes = np.clip(low + (u < x - low), 0, self.levels)
        else:
            codes = np.zeros(flat.numel())
        return {"lo": torch.tensor(lo, dtype=torch.float32), "hi": torch.tensor(hi, dtype=torch.float32),
                "codes": pack(codes.astype(np.uint32), self.bits)}

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        what = f"{self.name} decode"
        lo, hi = _scalar(parts, "lo", what), _scalar(parts, "hi", what)
        if lo > hi:
            raise PayloadError("BAD_SHAPE", f"{what}: lo {lo} > hi {hi}")
        packed = expect(parts, "codes", torch.uint8, (packed_len(numel, self.bits),), what)
        codes = unpack(packed, numel, self.bits, what)
        if hi == lo:
            if codes.any():
                raise PayloadError("BAD_SHAPE", f"{what}: lo == hi, so every code must be 0")
            return torch.full((numel,), lo, dtype=torch.float32)
        out = np.clip(lo + codes.astype(np.float64) * ((hi - lo) / self.levels), lo, hi)
        return torch.from_numpy(out.astype(np.float32))

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return 8 + packed_len(numel, self.bits)


# ----------------------------------------------------------------------------- natural compression
@dataclass(frozen=True)
class Natural:
    """Natural compression C_nat (Horvath et al. 2019, "Natural compression for distributed deep
    learning", arXiv:1905.10988: the definition of C_nat in the section that introduces it, and the
    second moment bound E[C_nat(v)^2] <= 9/8 v^2, i.e. omega = 1/8, of their Theorem 1; no copy of the
    paper was at hand to check section, theorem or equation numbers, so the formulas below state
    what is implemented): each v_i != 0, with 2^a <= |v_i| < 2^(a+1), becomes

        sign(v_i) 2^(a+1) with probability p_i = (|v_i| - 2^a) / 2^a,  else sign(v_i) 2^a,

    so E = v_i and Var = (|v_i| - 2^a)(2^(a+1) - |v_i|) <= v_i^2 / 8.  On float32 this is the
    paper's "ignore the mantissa" form: with E the biased exponent field and M the 23-bit mantissa
    field of |v_i|, 2^a has exponent field E and p_i = M / 2^23, so the new exponent field is
    E + [u_i < M / 2^23], u = torch.rand(d, generator=rng) (d draws on every call).  Since u takes
    the values j / 2^24 and p_i is a multiple of 2^-23, P(round up) = p_i exactly.

    Extremes (stated, as float32 allows):
    - subnormal |v_i| < 2^-126 (E = 0): rounded to 0 or to 2^-126 with P(2^-126) = M / 2^23 =
      |v_i| / 2^-126, the same formula: still unbiased, but the variance |v_i| (2^-126 - |v_i|) is
      not bounded by v_i^2 / 8 there;
    - 2^127 < |v_i| < 2^128 (E = 254, M > 0): 2^128 is not a float32, so these are always rounded
      down to 2^127 (biased, by less than half);
    - 0 and -0.0: exponent code 0 with sign bit 0 (decodes to +0.0);
    - +-Inf and NaN (exponent field 255) are sent with exponent code 255, as float32 writes them;
      the receiver rejects them (PayloadError NON_FINITE).

    Wire: part `codes`, uint8[ceil(9 d / 8)]: per element 9 bits MSB-first, the sign bit
    (1 = negative) then the 8-bit exponent code e, which is float32's biased exponent: e = 0 is zero,
    e in 1..254 is 2^(e - 127).  So decode is the float32 with sign s, exponent field e and a zero
    mantissa.  Rejected: e = 255 (float32's Inf/NaN: NON_FINITE), a sign bit on e = 0 (only +0 is sent),
    non-zero padding.  Bytes: ceil(9 d / 8).  No keys.
    """

    name: ClassVar[str] = "natural"
    unbiased: ClassVar[bool] = True

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        flat = _input(v, self.name)
        u = torch.rand(flat.numel(), generator=rng).numpy()
        word = flat.numpy().view(np.uint32)
        exponent = (word >> np.uint32(23)) & np.uint32(0xFF)
        mantissa = word & np.uint32(0x7FFFFF)
        p = mantissa.astype(np.float64) / float(1 << 23)             # exact: M < 2^23
        up = (u.astype(np.float64) < p) & (exponent < _EXP_MAX)
        e = exponent + up.astype(np.uint32)
        sign = (word >> np.uint32(31)) & (e > _EXP_ZERO).astype(np.uint32)
        return {"codes": pack((sign << np.uint32(8)) | e, 9)}

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        what = f"{self.name} decode"
        packed = expect(parts, "codes", torch.uint8, (packed_len(numel, 9),), what)
        codes = unpack(packed, numel, 9, what)
        e = codes & np.uint32(0xFF)
        sign = codes >> np.uint32(8)
        if bool((e > _EXP_MAX).any()):
            raise PayloadError("NON_FINITE", f"{what}: exponent code 255 (float32's Inf/NaN)")
        if bool(((e == _EXP_ZERO) & (sign == 1)).any()):
            raise PayloadError("BAD_SHAPE", f"{what}: a negative zero (sign bit with exponent code 0)")
        word = (sign << np.uint32(31)) | (e << np.uint32(23))
        return torch.from_numpy(word.view(np.float32).copy())

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return packed_len(numel, 9)


# ----------------------------------------------------------------------------- casts
def _cast(v: torch.Tensor, dtype: torch.dtype, what: str) -> Parts:
    """`v` cast to `dtype` (IEEE round to nearest, ties to even); a finite value that would round to
    Inf is saturated to the dtype's largest finite value, a non-finite one stays as it is."""
    flat = _input(v, what)
    lim = torch.finfo(dtype).max                # exact in float32 (65504, 2^128 - 2^120)
    return {"v": torch.where(torch.isfinite(flat), flat.clamp(-lim, lim), flat).to(dtype)}


def _uncast(parts: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    t = expect(parts, "v", dtype, (numel,), what)
    if not bool(torch.isfinite(t).all()):
        raise PayloadError("NON_FINITE", f"{what}: part 'v' holds NaN or Inf")
    return t.to(torch.float32)


@dataclass(frozen=True)
class Float16:
    """A cast to IEEE float16 (round to nearest, ties to even), as torch's DDP fp16_compress_hook
    sends gradients; decode casts back to float32 (exact).  Biased (deterministic rounding;
    relative error <= 2^-11 in the normal range, absolute <= 2^-25 below 2^-14).  A finite value
    whose float16 would be Inf (|v_i| >= 65520) is saturated to +-65504, as the sparse compressors'
    float16 values are, so a finite v always decodes; a non-finite v_i stays non-finite and the
    receiver rejects it (NON_FINITE).  Wire: part `v`, float16[d].  Bytes: 2 d.  No keys.
    """

    name: ClassVar[str] = "fp16"
    unbiased: ClassVar[bool] = False

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        return _cast(v, torch.float16, self.name)

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return _uncast(parts, numel, torch.float16, f"{self.name} decode")

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return 2 * numel


@dataclass(frozen=True)
class BFloat16:
    """A cast to bfloat16 (float32's top 16 bits, round to nearest, ties to even), as torch's DDP
    bf16_compress_hook sends gradients; decode casts back to float32 (exact).  Biased (relative
    error <= 2^-8 in the normal range).  A finite value that would round to Inf (|v_i| >= 2^128 -
    2^119, in float32's top binade) is saturated to bfloat16's largest finite value 2^128 - 2^120;
    a non-finite v_i stays non-finite and the receiver rejects it (NON_FINITE).
    Wire: part `v`, bfloat16[d].  Bytes: 2 d.  No keys.
    """

    name: ClassVar[str] = "bf16"
    unbiased: ClassVar[bool] = False

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        return _cast(v, torch.bfloat16, self.name)

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        return _uncast(parts, numel, torch.bfloat16, f"{self.name} decode")

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        return 2 * numel


QUANTIZERS: tuple[type, ...] = (Sign, ScaledSign, StochasticRounding, Natural, Float16, BFloat16)


REGISTER = QUANTIZERS   # the built-in compressors of this module (compressors/__init__.py)
