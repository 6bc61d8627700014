"""Sparsifiers (issue 47, item 1): top-k, random-k scaled to be unbiased, and threshold.

Each keeps a set S of the d coordinates of a flattened float32 tensor v and sends S and v_S:

    top-k      S = the k largest |v_i| (ties: the lower index first)       biased
               (Aji & Heafield, EMNLP 2017, Sec. 2; Stich, Cordonnier & Jaggi, NeurIPS 2018,
               Sec. 2, "top_k" of the k-contraction Definition 2.1)
    random-k   S = k indices uniform without replacement, values v_i * d / k    unbiased
               (Stich et al. 2018, Sec. 2, "rand_k"; Wangni et al., NeurIPS 2018, Sec. 3)
    threshold  S = {i : |v_i| >= tau}, |S| data dependent (0 allowed)       biased
               (Strom, Interspeech 2015, Sec. 2: threshold sparsification)

Random-k's moments, derived here since the tests bound them (P[i in S] = k / d):

    (S1)  E[C(v)_i]   = (k/d) * (d/k) v_i = v_i                         (unbiased)
    (S2)  Var[C(v)_i] = (k/d) (d/k)^2 v_i^2 - v_i^2 = (d/k - 1) v_i^2,
          so E||C(v) - v||^2 = (d/k - 1) ||v||^2 (Stich et al. 2018, Sec. 2, the scaled rand_k).

Wire format of one tensor (the parts of `base.py`; a part's bytes are its tensor's bytes):

- `val`: the kept values in ascending index order, as the `values` dtype (float32, float16 or
  bfloat16: 4, 2 or 2 bytes each), k elements.  A finite float32 value beyond the dtype's range is
  saturated to its largest finite value (float16: 65504), so a finite v always decodes; a
  non-finite v_i stays non-finite and the receiver rejects it (PayloadError NON_FINITE).
- exactly ONE index part, chosen per tensor as the smallest of the three; its name says which:
    `idx32`:  the k indices as uint32[k] (torch.uint32, made from numpy): 4 k bytes;
    `idxvar`: uint8[n], the delta-varint stream of `varint_encode`: the first index, then each gap
              MINUS ONE (i_j - i_{j-1} - 1 >= 0, the indices being distinct), each as unsigned
              LEB128 (7 bits a byte, least significant group first, high bit = more bytes follow):
              V(S) = sum_j max(1, ceil(bitlen(t_j) / 7)) bytes for the terms t_j;
    `bitmap`: uint8[ceil(d / 8)], bit i set when i is kept, MSB-first as np.packbits (bit i is
              0x80 >> (i % 8) of byte i // 8; the padding bits after d are zero).
  On equal sizes the order of preference is bitmap, then idx32, then idxvar (k = 0: idx32 of
  length 0, 0 bytes).  The decoder accepts only that canonical choice, so every accepted payload
  costs exactly the formula below.

So one tensor costs

    bytes(d, S) = s_val * k + min(4 k, V(S), ceil(d / 8)),        s_val = 4 (float32), 2 (float16, bfloat16)

with k = k(d) from the keys for top-k and random-k, k = |S| for threshold (`encoded_bytes`).
Indices fit uint32, so d <= 2^32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar, Mapping

import numpy as np
import torch

from fedhop.common.processors.compressors.base import Parts, expect, expect_1d
from fedhop.common.wire.codec import PayloadError

VALUE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                        "bfloat16": torch.bfloat16}
INDEX_PARTS = ("idx32", "idxvar", "bitmap")
MAX_NUMEL = 1 << 32             # indices travel as uint32
_VARINT_MAX_BYTES = 5           # an index < 2^32 (and so a term) needs at most ceil(32 / 7) = 5 bytes


# ----------------------------------------------------------------------------- index formats
def _terms(indices: np.ndarray) -> np.ndarray:
    """The varint terms of sorted distinct indices: t_0 = i_0, t_j = i_j - i_{j-1} - 1 (int64)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return idx
    return np.concatenate([idx[:1], np.diff(idx) - 1])


def _varint_lengths(terms: np.ndarray) -> np.ndarray:
    """Bytes of each term's LEB128 form: max(1, ceil(bitlen(t) / 7)) = 1 + #{m >= 1 : t >= 2^(7m)}."""
    n = np.ones(terms.shape, dtype=np.int64)
    for m in range(1, _VARINT_MAX_BYTES):
        n += terms >= (1 << (7 * m))
    return n


def varint_bytes(indices: np.ndarray) -> int:
    """V(S): the length of `varint_encode(indices)` without building it."""
    return int(_varint_lengths(_terms(indices)).sum())


def varint_encode(indices: np.ndarray) -> np.ndarray:
    """The delta-varint stream (module docstring) of sorted, distinct indices in [0, 2^32), uint8[V(S)]."""
    t = _terms(indices)
    if t.size and (t.min() < 0 or t.max() >= MAX_NUMEL):
        raise ValueError("varint_encode: indices must be sorted, distinct and < 2^32")
    n = _varint_lengths(t)
    start = np.cumsum(n) - n
    out = np.empty(int(n.sum()), dtype=np.uint8)
    for b in range(_VARINT_MAX_BYTES):
        has = n > b
        group = (t[has] >> (7 * b)) & 0x7F
        more = np.where(n[has] > b + 1, 0x80, 0)
        out[start[has] + b] = (group | more).astype(np.uint8)
    return out


def varint_decode(stream: np.ndarray, d: int, max_count: int) -> np.ndarray:
    """The indices (int64, strictly increasing, < d) of a delta-varint stream; PayloadError when it
    ends inside a varint (an overrun), holds a non-minimal varint (a last byte 0 after others), more
    than `max_count` varints, a varint longer than 5 bytes, or an index >= d."""
    s = np.asarray(stream, dtype=np.uint8)
    if s.size == 0:
        return np.zeros(0, dtype=np.int64)
    last = (s & 0x80) == 0
    if not last[-1]:
        raise PayloadError("BAD_SHAPE", "sparse indices: the varint stream ends inside a varint")
    ends = np.flatnonzero(last)
    if ends.size > max_count:
        raise PayloadError("BAD_SHAPE", f"sparse indices: {ends.size} varints, at most {max_count} expected")
    starts = np.concatenate([[0], ends[:-1] + 1])
    length = ends - starts + 1
    if length.max() > _VARINT_MAX_BYTES:
        raise PayloadError("BAD_SHAPE", f"sparse indices: a varint of more than {_VARINT_MAX_BYTES} bytes")
    if bool(((length > 1) & (s[ends] == 0)).any()):
        raise PayloadError("BAD_SHAPE", "sparse indices: a varint is not in its shortest form")
    t = np.zeros(ends.size, dtype=np.int64)
    for b in range(_VARINT_MAX_BYTES):
        has = length > b
        t[has] |= (s[starts[has] + b].astype(np.int64) & 0x7F) << (7 * b)
    if bool((t >= d).any()):       # bounds each term, so the sum below stays far below 2^63
        raise PayloadError("BAD_SHAPE", f"sparse indices: an index beyond d = {d}")
    idx = np.cumsum(t) + np.arange(t.size, dtype=np.int64)     # i_j = i_{j-1} + t_j + 1
    if idx[-1] >= d:
        raise PayloadError("BAD_SHAPE", f"sparse indices: index {int(idx[-1])} is beyond d = {d}")
    return idx


def index_bytes(indices: np.ndarray, d: int) -> int:
    """min(4 k, V(S), ceil(d / 8)): the bytes of the smallest index format of `indices`."""
    k = int(np.asarray(indices).size)
    return min(4 * k, varint_bytes(indices), (d + 7) // 8)


def index_format(indices: np.ndarray, d: int) -> str:
    """The part that carries `indices`: the smallest, ties to bitmap, then idx32, then idxvar."""
    k = int(np.asarray(indices).size)
    bitmap, idx32, var = (d + 7) // 8, 4 * k, varint_bytes(indices)
    if bitmap <= idx32 and bitmap <= var:
        return "bitmap"
    return "idx32" if idx32 <= var else "idxvar"


def encode_indices(indices: np.ndarray, d: int) -> Parts:
    """{format: tensor} of sorted distinct int64 `indices` < d in their canonical format."""
    idx = np.asarray(indices, dtype=np.int64)
    fmt = index_format(idx, d)
    if fmt == "bitmap":
        bits = np.zeros(d, dtype=np.uint8)
        bits[idx] = 1
        return {"bitmap": torch.from_numpy(np.packbits(bits))}
    if fmt == "idx32":
        return {"idx32": torch.from_numpy(idx.astype(np.uint32))}
    return {"idxvar": torch.from_numpy(varint_encode(idx))}


def decode_indices(parts: Mapping[str, torch.Tensor], d: int, k: int, what: str) -> np.ndarray:
    """The k indices (int64, strictly increasing, < d) of the one index part of `parts`, checked to
    be in the canonical format (PayloadError otherwise)."""
    present = [p for p in INDEX_PARTS if p in parts]
    if len(present) != 1:
        raise PayloadError("BAD_NAME", f"{what}: exactly one of the parts {', '.join(INDEX_PARTS)} expected, "
                                       f"got {present or 'none'}")
    fmt = present[0]
    bitmap_len = (d + 7) // 8
    if fmt == "bitmap":
        packed = expect(parts, "bitmap", torch.uint8, (bitmap_len,), what).numpy()
        bits = np.unpackbits(packed)
        if bits[d:].any():
            raise PayloadError("BAD_SHAPE", f"{what}: a bitmap bit is set beyond d = {d}")
        if int(bits.sum()) != k:
            raise PayloadError("BAD_SHAPE", f"{what}: the bitmap has {int(bits.sum())} bits set, {k} values sent")
        idx = np.flatnonzero(bits).astype(np.int64)
    elif fmt == "idx32":
        raw = expect(parts, "idx32", torch.uint32, (k,), what).numpy()
        idx = raw.astype(np.int64)
        if idx.size and (idx[-1] >= d or bool((np.diff(idx) <= 0).any())):
            raise PayloadError("BAD_SHAPE", f"{what}: idx32 must be strictly increasing and < d = {d}")
    else:
        stream = expect_1d(parts, "idxvar", torch.uint8, what, min(4 * k, bitmap_len)).numpy()
        idx = varint_decode(stream, d, k)
        if idx.size != k:
            raise PayloadError("BAD_SHAPE", f"{what}: the varint stream holds {idx.size} indices, {k} values sent")
    if index_format(idx, d) != fmt:
        raise PayloadError("BAD_SHAPE", f"{what}: indices sent as {fmt}, but {index_format(idx, d)} is smaller "
                                        f"(or equal and preferred)")
    return idx


# ----------------------------------------------------------------------------- values
def encode_values(v: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float32 v * float32(scale) cast to `dtype` (round to nearest even), a finite v saturated to
    the dtype's largest finite value instead of overflowing."""
    x = v * torch.tensor(scale, dtype=torch.float32) if scale != 1.0 else v
    lim = torch.finfo(dtype).max
    x = torch.where(torch.isfinite(v), x.clamp(-lim, lim), x)
    return x.to(dtype)


def decode_values(parts: Mapping[str, torch.Tensor], dtype: torch.dtype, k: int | None, d: int,
                  what: str) -> torch.Tensor:
    """Part `val`: `dtype`[k] (or [<= d] when k is None), all finite, as float32."""
    val = expect(parts, "val", dtype, (k,), what) if k is not None else expect_1d(parts, "val", dtype, what, d)
    if not bool(torch.isfinite(val).all()):
        raise PayloadError("NON_FINITE", f"{what}: a kept value is not finite")
    return val.to(torch.float32)


def _check_input(v: torch.Tensor, what: str) -> int:
    if v.dtype != torch.float32 or v.dim() != 1 or not 1 <= v.numel() <= MAX_NUMEL:
        raise ValueError(f"{what}.encode: expected float32[d], 1 <= d <= 2^32, got {v.dtype}{list(v.shape)}")
    return v.numel()


def _check_parts(parts: Mapping[str, torch.Tensor], what: str) -> None:
    extra = sorted(set(parts) - {"val", *INDEX_PARTS})
    if extra:
        raise PayloadError("BAD_NAME", f"{what}: unknown parts {extra}")


def _scatter(d: int, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(d, dtype=torch.float32)
    out[idx] = val
    return out


# ----------------------------------------------------------------------------- compressors
_VALUES_HELP = "dtype of the kept values on the wire: float32 (4 bytes), float16 or bfloat16 (2 bytes)"


@dataclass(frozen=True)
class _CountKeys:
    """The keys of a sparsifier that keeps a fixed count k(d) (top-k, random-k)."""

    ratio: float = field(default=0.01, metadata={
        "min_exclusive": 0.0, "max": 1.0,
        "help": "fraction of the elements kept when k = 0: k = max(1, ceil(ratio * d))"})
    k: int = field(default=0, metadata={
        "min": 0, "help": "elements kept per tensor (min(k, d)); 0 = use ratio"})
    values: str = field(default="float32", metadata={"choices": tuple(VALUE_DTYPES), "help": _VALUES_HELP})

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, (int, float)) and 0.0 < self.ratio <= 1.0):
            raise ValueError(f"compression {self.name}.ratio: got {self.ratio!r}, must be in (0, 1]")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"compression {self.name}.k: got {self.k!r}, must be an int >= 0")
        if self.values not in VALUE_DTYPES:
            raise ValueError(f"compression {self.name}.values: got {self.values!r}, allowed: "
                             f"{', '.join(VALUE_DTYPES)}")

    def count(self, d: int) -> int:
        """k(d) = min(k, d) when k > 0, else max(1, ceil(ratio * d)) with ratio taken as the decimal it is
        written as (Python's shortest repr: 0.07 * 100 is 7, not the 8 of float 7.000000000000001)."""
        if self.k > 0:
            return min(self.k, d)
        return min(d, max(1, math.ceil(Fraction(repr(float(self.ratio))) * d)))

    def _select(self, v: torch.Tensor, d: int, k: int, rng: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def _scale(self, d: int, k: int) -> float:
        return 1.0

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        """{"val": values[k], one of idx32 / idxvar / bitmap} (module docstring)."""
        d = _check_input(v, self.name)
        k = self.count(d)
        idx = self._select(v.detach().cpu(), d, k, rng)           # int64, ascending
        parts = encode_indices(idx.numpy(), d)
        parts["val"] = encode_values(v.detach().cpu()[idx], self._scale(d, k), VALUE_DTYPES[self.values])
        return parts

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        """float32[numel], zero off the kept indices; PayloadError for any malformed part."""
        return _scatter(numel, *self.decode_sparse(parts, numel))

    def decode_sparse(self, parts: Mapping[str, torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int64[k] strictly increasing, values float32[k]): what `decode` scatters into
        zeros (a streaming fold adds them where they belong: common/wire/message.py SparseTensor)."""
        what = f"{self.name} of {numel} elements"
        _check_parts(parts, what)
        k = self.count(numel)
        val = decode_values(parts, VALUE_DTYPES[self.values], k, numel, what)
        return torch.from_numpy(decode_indices(parts, numel, k, what)), val

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        """s_val * k + min(4 k, V(S), ceil(d / 8)) with k = k(d) and S read from the index part."""
        k = self.count(numel)
        idx = decode_indices(parts, numel, k, f"{self.name} of {numel} elements")
        return VALUE_DTYPES[self.values].itemsize * k + index_bytes(idx, numel)


@dataclass(frozen=True)
class TopK(_CountKeys):
    """Top-k sparsification (biased): keeps the k = k(d) coordinates of largest |v_i|, ties broken
    by the lower index (deterministic; a NaN counts as the largest), and sends them unscaled.
    Wire format and bytes: module docstring.

    Keys: `ratio` (float in (0, 1], default 0.01: k = max(1, ceil(ratio * d)) when `k` = 0),
    `k` (int >= 0, default 0 = use ratio; above d means d), `values` (float32 | float16 | bfloat16).
    """

    name: ClassVar[str] = "topk"
    unbiased: ClassVar[bool] = False

    def _select(self, v: torch.Tensor, d: int, k: int, rng: torch.Generator) -> torch.Tensor:
        a = torch.nan_to_num(v.abs(), nan=math.inf)
        kth = torch.topk(a, k, sorted=False).values.min()       # the k-th largest |v_i|
        above = torch.nonzero(a > kth).reshape(-1)
        tied = torch.nonzero(a == kth).reshape(-1)[: k - above.numel()]   # lower indices first
        return torch.sort(torch.cat([above, tied])).values


@dataclass(frozen=True)
class RandK(_CountKeys):
    """Random-k sparsification scaled to be unbiased: k = k(d) indices drawn uniformly without
    replacement, S = sorted(torch.randperm(d, generator=rng)[:k]), values float32 v_i * (d / k)
    (the scale rounded to float32 once) cast to `values`.  E[decode(encode(v))] = v (S1), per
    coordinate variance (d/k - 1) v_i^2 (S2) in the module docstring; with float16/bfloat16 values
    unbiased up to their rounding.  Wire format and bytes: module docstring.

    Keys: `ratio` (float in (0, 1], default 0.01: k = max(1, ceil(ratio * d)) when `k` = 0),
    `k` (int >= 0, default 0 = use ratio; above d means d), `values` (float32 | float16 | bfloat16).
    """

    name: ClassVar[str] = "randk"
    unbiased: ClassVar[bool] = True

    def _select(self, v: torch.Tensor, d: int, k: int, rng: torch.Generator) -> torch.Tensor:
        return torch.sort(torch.randperm(d, generator=rng)[:k]).values

    def _scale(self, d: int, k: int) -> float:
        return d / k


@dataclass(frozen=True)
class Threshold:
    """Threshold sparsification (biased): keeps every coordinate with |v_i| >= `threshold` (NaN is
    never kept), unscaled; k = |S| depends on the data (0 allowed: then 0 bytes, an empty idx32
    and val).  Wire format and bytes (k = len(val)): module docstring.

    Keys: `threshold` (float >= 0, default 1e-3; 0 keeps everything), `values`
    (float32 | float16 | bfloat16, default float32).
    """

    threshold: float = field(default=1e-3, metadata={
        "min": 0.0, "help": "keep the elements with |v_i| >= threshold (their count is data dependent)"})
    values: str = field(default="float32", metadata={"choices": tuple(VALUE_DTYPES), "help": _VALUES_HELP})

    name: ClassVar[str] = "threshold"
    unbiased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"compression threshold.threshold: got {self.threshold!r}, must be a finite float >= 0")
        if self.values not in VALUE_DTYPES:
            raise ValueError(f"compression threshold.values: got {self.values!r}, allowed: "
                             f"{', '.join(VALUE_DTYPES)}")

    def encode(self, v: torch.Tensor, rng: torch.Generator) -> Parts:
        """{"val": values[k], one of idx32 / idxvar / bitmap}; draws nothing from `rng`."""
        d = _check_input(v, self.name)
        x = v.detach().cpu()
        idx = torch.nonzero(x.abs() >= self.threshold).reshape(-1)
        parts = encode_indices(idx.numpy(), d)
        parts["val"] = encode_values(x[idx], 1.0, VALUE_DTYPES[self.values])
        return parts

    def decode(self, parts: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
        """float32[numel], zero off the kept indices; PayloadError for any malformed part (the
        indices' count must equal len(val))."""
        return _scatter(numel, *self.decode_sparse(parts, numel))

    def decode_sparse(self, parts: Mapping[str, torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int64[k] strictly increasing, values float32[k]): what `decode` scatters into zeros."""
        what = f"threshold of {numel} elements"
        _check_parts(parts, what)
        val = decode_values(parts, VALUE_DTYPES[self.values], None, numel, what)
        return torch.from_numpy(decode_indices(parts, numel, val.numel(), what)), val

    def encoded_bytes(self, numel: int, parts: Mapping[str, torch.Tensor]) -> int:
        """s_val * k + min(4 k, V(S), ceil(d / 8)) with k = len(val) and S read from the index part."""
        what = f"threshold of {numel} elements"
        val = expect_1d(parts, "val", VALUE_DTYPES[self.values], what, numel)
        idx = decode_indices(parts, numel, val.numel(), what)
        return VALUE_DTYPES[self.values].itemsize * val.numel() + index_bytes(idx, numel)


REGISTER = [TopK, RandK, Threshold]   # the built-in compressors of this module (compressors/__init__.py)
