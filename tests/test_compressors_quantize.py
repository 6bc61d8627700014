"""The quantizing compressors of issue 47 (common/processors/compressors/quantize.py): sign, scaled
sign, b-bit stochastic rounding, natural compression, float16 and bfloat16 casts.

- each equals an independent numpy reference on held-out tensors (d = 1, 2, 7, 1000, 4097): the
  packed bytes against a pure-Python bit-string packer, the decoded values bit for bit; the random
  ones with the same uniforms (u = torch.rand(d) from a copy of the generator);
- stochastic rounding and natural compression are unbiased within 5 standard errors per
  coordinate, from their variance bounds (step^2 / 4, v^2 / 8);
- bytes: encoded_bytes == nbytes(parts) == a closed form written here;
- every malformed part raises PayloadError, and random bytes never raise anything else.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedhop.common.processors.compressors.base import Compressor, nbytes
from fedhop.common.processors.compressors.quantize import (
    BFloat16,
    Float16,
    Natural,
    ScaledSign,
    Sign,
    StochasticRounding,
)
from fedhop.common.wire.codec import PayloadError

DIMS = (1, 2, 7, 1000, 4097)
TINY = 2.0 ** -126           # float32's smallest normal


# ----------------------------------------------------------------------------- references
def held_out(d: int, seed: int) -> np.ndarray:
    """float32[d]: normal values at scales 1e-3..1e2, with zeros, -0.0 and a repeated value when
    there is room (seeds 1000+, not used in the module)."""
    rng = np.random.default_rng(1000 + seed * 7919 + d)
    x = rng.standard_normal(d) * 10.0 ** rng.integers(-3, 3, size=d)
    if d >= 7:
        x[rng.choice(d, 3, replace=False)] = [0.0, -0.0, x[0]]
    return x.astype(np.float32)


def ref_pack(codes, bits: int) -> bytes:
    """MSB-first, zero-padded packing through a bit string (no numpy bit functions)."""
    s = "".join(format(int(c), f"0{bits}b") for c in codes)
    s += "0" * (-len(s) % 8)
    return bytes(int(s[i:i + 8], 2) for i in range(0, len(s), 8))


def copy_of(g: torch.Generator) -> torch.Generator:
    c = torch.Generator()
    c.set_state(g.get_state())
    return c


def bits_equal(a: torch.Tensor, b: np.ndarray) -> bool:
    """float32 tensors equal bit for bit (so +0.0 != -0.0)."""
    return a.dtype == torch.float32 and np.array_equal(a.numpy().view(np.uint32), b.astype(np.float32).view(np.uint32))


def ref_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32 with round to nearest even, on the bits (finite x)."""
    w = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    w = ((w + 0x7FFF + ((w >> 16) & 1)) >> 16) << 16
    return w.astype(np.uint32).view(np.float32)


def ref_natural(x: np.ndarray, u: np.ndarray) -> np.ndarray:
    """C_nat on float64 from frexp: low = 2^floor(log2|x|), p = (|x| - low) / low; below 2^-126 the
    two candidates are 0 and 2^-126 with p = |x| / 2^-126; at 2^127 <= |x| no rounding up."""
    out = np.zeros(x.size)
    for i, (xi, ui) in enumerate(zip(x.astype(np.float64), u.astype(np.float64))):
        a = abs(xi)
        if a == 0.0:
            continue
        if a < TINY:
            low, high = 0.0, TINY
        else:
            _, e = math.frexp(a)                 # a = m 2^e, m in [0.5, 1)
            low = 2.0 ** (e - 1)
            high = 2.0 * low if e - 1 < 127 else low
        p = (a - low) / (high - low) if high > low else 0.0
        out[i] = math.copysign(high if ui < p else low, xi)
    return out


def natural_codes(y: np.ndarray) -> list[int]:
    """The 9-bit codes of values that are 0 or +-2^k: sign << 8 | (k + 127), 0 for 0."""
    out = []
    for yi in y:
        if yi == 0.0:
            out.append(0)
        else:
            k = math.frexp(abs(yi))[1] - 1
            out.append(((1 << 8) if yi < 0 else 0) | (k + 127))
    return out


# ----------------------------------------------------------------------------- deterministic ones
@pytest.mark.parametrize("d", DIMS)
def test_sign_equals_numpy(d):
    x = held_out(d, 1)
    parts = Sign().encode(torch.from_numpy(x), torch.Generator())
    assert set(parts) == {"bits"}
    assert bytes(parts["bits"].numpy()) == ref_pack([1 if xi < 0 else 0 for xi in x], 1)
    assert bits_equal(Sign().decode(parts, d), np.where(x >= 0, 1.0, -1.0))     # sign(0) = sign(-0.0) = +1


@pytest.mark.parametrize("d", DIMS)
def test_scaled_sign_equals_numpy(d):
    x = held_out(d, 2)
    parts = ScaledSign().encode(torch.from_numpy(x), torch.Generator())
    scale = np.float32(math.fsum(abs(float(xi)) for xi in x) / d)
    assert parts["scale"].dtype == torch.float32 and parts["scale"].dim() == 0
    assert float(parts["scale"]) == float(scale)
    assert bytes(parts["bits"].numpy()) == ref_pack([1 if xi < 0 else 0 for xi in x], 1)
    assert bits_equal(ScaledSign().decode(parts, d), np.where(x >= 0, scale, -scale))


def test_scaled_sign_of_zero_vector_is_zero():
    parts = ScaledSign().encode(torch.zeros(9), torch.Generator())
    assert float(parts["scale"]) == 0.0 and bits_equal(ScaledSign().decode(parts, 9), np.zeros(9))


# ties at the rounding point go to even: float16 1 + 2^-11 -> 1, 1 + 3 2^-11 -> 1 + 2^-9, subnormal 1.5 2^-24 ->
# 2^-23, 2^-25 -> 0; bfloat16 1 + 2^-8 -> 1, 1 + 3 2^-8 -> 1 + 2^-6; and float16's edge 65504 / 65519 -> 65504
TIES = np.array([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                 2 ** -24 * 1.5, 2 ** -25, 65504.0, 65519.0, -65519.0, 1e-30, -3e-41], dtype=np.float32)


@pytest.mark.parametrize("d", DIMS)
def test_float16_equals_numpy(d):
    x = held_out(d, 3)
    x[: min(d, TIES.size)] = TIES[: min(d, TIES.size)]
    parts = Float16().encode(torch.from_numpy(x), torch.Generator())
    assert parts["v"].dtype == torch.float16 and tuple(parts["v"].shape) == (d,)
    assert bits_equal(Float16().decode(parts, d), x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("d", DIMS)
def test_bfloat16_equals_numpy(d):
    x = held_out(d, 4)
    big = np.array([3.0e38, -3.3e38, 2.0 ** 127 * (2 - 2 ** -7)], dtype=np.float32)   # bf16's top binade
    x[: min(d, TIES.size)] = TIES[: min(d, TIES.size)]
    if d >= TIES.size + big.size:
        x[TIES.size: TIES.size + big.size] = big
    parts = BFloat16().encode(torch.from_numpy(x), torch.Generator())
    assert parts["v"].dtype == torch.bfloat16 and tuple(parts["v"].shape) == (d,)
    assert bits_equal(BFloat16().decode(parts, d), ref_bf16(x))


def test_ties_go_to_even():
    """The reference itself: the tie cases above round as the standard says."""
    assert list(TIES[:5].astype(np.float16).astype(np.float32)) == [1.0, 1 + 2 ** -9, -1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8]
    assert list(ref_bf16(TIES[:5])) == [1.0, 1.0, -1.0, 1.0, 1 + 2 ** -6]


def test_casts_saturate_finite_overflow():
    """A finite value beyond the 16-bit range decodes as the largest finite value (sign kept)."""
    x = torch.tensor([1.0, 65519.0, 65520.0, 1e6, -1e9, 3.4e38])
    assert Float16().decode(Float16().encode(x, torch.Generator()), 6).tolist() == [1.0, 65504.0, 65504.0, 65504.0,
                                                                                    -65504.0, 65504.0]
    bf_max = 2.0 ** 128 - 2.0 ** 120
    y = torch.tensor([3.0e38, -3.4e38, float(np.float32(2.0 ** 128 - 2.0 ** 119))])
    assert BFloat16().decode(BFloat16().encode(y, torch.Generator()), 3).tolist() == [float(ref_bf16(
        np.float32([3.0e38]))[0]), -bf_max, bf_max]


NON_FINITE = (float("nan"), float("inf"), float("-inf"))


@pytest.mark.parametrize("c", [ScaledSign(), StochasticRounding(), StochasticRounding(bits=1), Natural(),
                               Float16(), BFloat16()], ids=lambda c: c.name)
def test_non_finite_input_is_rejected_by_the_receiver(c):
    """A diverged sender's NaN/Inf travels so that the receiver rejects it (NON_FINITE), with
    the byte formula unchanged."""
    for bad in NON_FINITE:
        for d in (1, 9):
            x = torch.linspace(-1, 1, d)
            x[d // 2] = bad
            parts = c.encode(x, torch.Generator().manual_seed(d))
            assert c.encoded_bytes(d, parts) == nbytes(parts)
            with pytest.raises(PayloadError, match="NON_FINITE"):
                c.decode(parts, d)


def test_sign_refuses_nan_and_signs_inf():
    with pytest.raises(ValueError, match="NaN"):
        Sign().encode(torch.tensor([1.0, float("nan")]), torch.Generator())
    x = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0])
    assert Sign().decode(Sign().encode(x, torch.Generator()), 4).tolist() == [1.0, -1.0, 1.0, 1.0]


def test_encode_refuses_wrong_tensors():
    for c in (Sign(), ScaledSign(), StochasticRounding(), Natural(), Float16(), BFloat16()):
        for bad in (torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2), torch.zeros(0), torch.tensor(1.0)):
            with pytest.raises(ValueError, match="1-D float32"):
                c.encode(bad, torch.Generator())


# ----------------------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("bits", [1, 3, 8, 16])
@pytest.mark.parametrize("d", DIMS)
def test_rounding_equals_numpy(d, bits):
    x = held_out(d, 5 + bits)
    g = torch.Generator().manual_seed(77 + d)
    u = torch.rand(d, generator=copy_of(g)).numpy().astype(np.float64)
    c = StochasticRounding(bits=bits)
    parts = c.encode(torch.from_numpy(x), g)
    levels = 2 ** bits - 1
    lo, hi = float(x.min()), float(x.max())
    if hi > lo:
        pos = (x.astype(np.float64) - lo) / (hi - lo) * levels
        codes = np.minimum(np.floor(pos) + (u < pos - np.floor(pos)), levels)
        expect = np.clip(lo + codes * ((hi - lo) / levels), lo, hi)
    else:
        codes, expect = np.zeros(d), np.full(d, lo)
    assert float(parts["lo"]) == lo and float(parts["hi"]) == hi
    assert parts["lo"].dim() == 0 and parts["hi"].dim() == 0
    assert bytes(parts["codes"].numpy()) == ref_pack(codes.astype(int), bits)
    assert bits_equal(c.decode(parts, d), expect)
    if d >= 1000:
        assert codes.max() == levels and codes.min() == 0     # the max codes L, the min codes 0


def test_rounding_draws_d_uniforms_and_is_deterministic():
    x = torch.from_numpy(held_out(50, 6))
    for c in (StochasticRounding(bits=4), Natural()):
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        a, b = c.encode(x, g1), c.encode(x, g2)
        assert all(torch.equal(a[k], b[k]) for k in a)
        ref = torch.Generator().manual_seed(3)
        torch.rand(50, generator=ref)
        assert torch.equal(g1.get_state(), ref.get_state())
    const = torch.full((5,), -2.5)                      # hi == lo: all codes 0, decode lo, still 5 draws
    g = torch.Generator().manual_seed(4)
    parts = StochasticRounding(bits=3).encode(const, g)
    assert bytes(parts["codes"].numpy()) == bytes(2) and bits_equal(StochasticRounding(bits=3).decode(parts, 5),
                                                                    np.full(5, -2.5))


def test_rounding_keys():
    for bad in (0, 17, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="rounding.bits"):
            StochasticRounding(bits=bad)            # type: ignore[arg-type]
    meta = {f.name: f.metadata for f in dataclasses.fields(StochasticRounding)}
    assert meta["bits"]["min"] == 1 and meta["bits"]["max"] == 16 and meta["bits"]["help"]
    assert StochasticRounding().bits == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        StochasticRounding().bits = 4               # type: ignore[misc]


N_DRAWS = 4000


def _draws(c, x: np.ndarray, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    v = torch.from_numpy(x)
    return np.stack([c.decode(c.encode(v, g), x.size).numpy().astype(np.float64) for _ in range(N_DRAWS)])


@pytest.mark.parametrize("bits", [1, 2, 5])
def test_rounding_unbiased(bits):
    """Per coordinate |mean - v| <= 5 sqrt(Var / N) + 2^-22 |v|max (float32 rounding of the
    decoded levels), Var <= step^2 / 4 (Suresh et al. Sec. 2.2); the sample variance is the
    closed form f (1 - f) step^2 within 15 % on the average over coordinates."""
    x = held_out(40, 20 + bits)
    c = StochasticRounding(bits=bits)
    y = _draws(c, x, seed=bits)
    lo, hi = float(x.min()), float(x.max())
    step = (hi - lo) / (2 ** bits - 1)
    err = np.abs(y.mean(0) - x.astype(np.float64))
    bound = 5 * math.sqrt(step ** 2 / 4 / N_DRAWS) + 2.0 ** -22 * max(abs(lo), abs(hi))
    assert err.max() <= bound, (err.max(), bound)
    pos = (x.astype(np.float64) - lo) / step
    f = pos - np.floor(pos)
    var = f * (1 - f) * step ** 2
    assert abs(y.var(0).mean() / var.mean() - 1) < 0.15
    # the bound catches a biased rounding: rounding to the nearest level would miss it
    nearest = lo + np.round(pos) * step
    assert np.abs(nearest - x).max() > 2 * bound


def test_natural_unbiased():
    """Normal values: |mean - v| <= 5 sqrt(v^2 / 8 / N) (Horvath et al., Var <= v^2 / 8); subnormal
    ones with their exact variance |v| (2^-126 - |v|); exact powers of two never move."""
    rng = np.random.default_rng(4242)
    normal = (rng.standard_normal(40) * 10.0 ** rng.integers(-20, 20, size=40)).astype(np.float32)
    sub = np.array([1e-39, -3e-40, 5e-45, -1.1e-38], dtype=np.float32)
    powers = np.array([1.0, -0.5, 2.0 ** -126, 2.0 ** 127, 0.0], dtype=np.float32)
    x = np.concatenate([normal, sub, powers])
    y = _draws(Natural(), x, seed=11)
    x64 = x.astype(np.float64)
    n = normal.size
    assert np.all(np.abs(y.mean(0)[:n] - x64[:n]) <= 5 * np.sqrt(x64[:n] ** 2 / 8 / N_DRAWS))
    s = slice(n, n + sub.size)
    var_sub = np.abs(x64[s]) * (TINY - np.abs(x64[s]))
    assert np.all(np.abs(y.mean(0)[s] - x64[s]) <= 5 * np.sqrt(var_sub / N_DRAWS))
    assert np.array_equal(y[:, n + sub.size:], np.broadcast_to(x64[n + sub.size:], (N_DRAWS, powers.size)))
    # second moment E[C(v)^2] <= 9/8 v^2 (their Theorem 1), here on the sample within 10 %
    assert np.all((y[:, :n] ** 2).mean(0) <= 9 / 8 * x64[:n] ** 2 * 1.1)
    assert np.all(np.isin(np.abs(y[:, :n]), 2.0 ** np.arange(-149, 128)))           # only powers of two


@pytest.mark.parametrize("d", DIMS)
def test_natural_equals_numpy(d):
    x = held_out(d, 8)
    extremes = np.array([2.0 ** 127, 3.0e38, -3.4028235e38, TINY, -TINY, 1e-39, -7e-42, 1.4e-45, 0.0, -0.0,
                         1.5, -0.75], dtype=np.float32)
    x[: min(d, extremes.size)] = extremes[: min(d, extremes.size)]
    g = torch.Generator().manual_seed(99 + d)
    u = torch.rand(d, generator=copy_of(g)).numpy()
    parts = Natural().encode(torch.from_numpy(x), g)
    expect = ref_natural(x, u)
    assert set(parts) == {"codes"}
    assert bytes(parts["codes"].numpy()) == ref_pack(natural_codes(expect), 9)
    out = Natural().decode(parts, d)
    assert bits_equal(out, np.where(expect == 0, 0.0, expect))    # zero decodes to +0.0
    assert bool(torch.isfinite(out).all())
    if d >= extremes.size:
        assert out[0] == 2.0 ** 127 and out[1] == 2.0 ** 127 and out[2] == -(2.0 ** 127)   # no 2^128


# ----------------------------------------------------------------------------- bytes
def closed_form(c, d: int) -> int:
    if isinstance(c, Sign):
        return math.ceil(d / 8)
    if isinstance(c, ScaledSign):
        return 4 + math.ceil(d / 8)
    if isinstance(c, StochasticRounding):
        return 4 + 4 + math.ceil(d * c.bits / 8)
    if isinstance(c, Natural):
        return math.ceil(d * 9 / 8)
    return d * 2


ALL = (Sign(), ScaledSign(), StochasticRounding(), StochasticRounding(bits=1), StochasticRounding(bits=13),
       StochasticRounding(bits=16), Natural(), Float16(), BFloat16())


@pytest.mark.parametrize("c", ALL, ids=lambda c: f"{c.name}{getattr(c, 'bits', '')}")
def test_bytes_equal_formula(c):
    g = torch.Generator().manual_seed(5)
    for d in list(range(1, 42)) + [1000, 4097]:
        parts = c.encode(torch.from_numpy(held_out(d, 9)), g)
        assert c.encoded_bytes(d, parts) == nbytes(parts) == closed_form(c, d), (c, d)
        assert all(p.device.type == "cpu" and p.is_contiguous() for p in parts.values())


def test_names_and_protocol():
    names = {c.name: c.unbiased for c in ALL}
    assert names == {"sign": False, "scaled_sign": False, "rounding": True, "natural": True,
                     "fp16": False, "bf16": False}
    for c in ALL:
        assert isinstance(c, Compressor) and dataclasses.is_dataclass(c)
        assert c.__doc__ and "Bytes" in c.__doc__


# ----------------------------------------------------------------------------- malformed parts
def _valid(c, d: int = 13) -> dict[str, torch.Tensor]:
    return c.encode(torch.from_numpy(held_out(d, 10)), torch.Generator().manual_seed(1))


def _with(parts, **changes):
    out = dict(parts)
    for k, v in changes.items():
        if v is None:
            out.pop(k)
        else:
            out[k] = v
    return out


def malformed_cases():
    """(compressor, label, parts, d); each must raise PayloadError (d = 13, natural's last two d = 8)."""
    cases = []
    for c in (Sign(), ScaledSign(), StochasticRounding(bits=3), Natural()):
        key = "bits" if isinstance(c, (Sign, ScaledSign)) else "codes"
        p = _valid(c)
        good = p[key]
        cases += [(c, label, parts, 13) for label, parts in (
            (f"{key} missing", _with(p, **{key: None})),
            (f"{key} int8", _with(p, **{key: good.to(torch.int8)})),
            (f"{key} float32", _with(p, **{key: good.to(torch.float32)})),
            (f"{key} short", _with(p, **{key: good[:-1]})),
            (f"{key} long", _with(p, **{key: torch.cat([good, torch.zeros(1, dtype=torch.uint8)])})),
            (f"{key} 2-D", _with(p, **{key: good.reshape(1, -1)})),
            (f"{key} padding bit", _with(p, **{key: torch.cat([good[:-1], good[-1:] | 1])})),
        )]
    sc = ScaledSign()
    s = _valid(sc)
    for label, val in (("nan", float("nan")), ("inf", float("inf")), ("negative", -1.0)):
        cases.append((sc, f"scale {label}", _with(s, scale=torch.tensor(val)), 13))
    cases += [(sc, "scale missing", _with(s, scale=None), 13),
              (sc, "scale float64", _with(s, scale=s["scale"].double()), 13),
              (sc, "scale [1]", _with(s, scale=s["scale"].reshape(1)), 13)]
    rc = StochasticRounding(bits=3)
    r = _valid(rc)
    for part in ("lo", "hi"):
        for label, val in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
            cases.append((rc, f"{part} {label}", _with(r, **{part: torch.tensor(val)}), 13))
        cases += [(rc, f"{part} missing", _with(r, **{part: None}), 13),
                  (rc, f"{part} float16", _with(r, **{part: r[part].half()}), 13),
                  (rc, f"{part} [1]", _with(r, **{part: r[part].reshape(1)}), 13)]
    cases += [(rc, "lo > hi", _with(r, lo=r["hi"] + 1.0), 13),
              (rc, "lo == hi, codes not 0", _with(r, lo=r["hi"].clone()), 13),
              (rc, "codes of 8 bits", _valid(StochasticRounding(bits=8)), 13)]
    nc = Natural()
    n = _valid(nc, d=8)                                 # 72 bits: 9 bytes, no padding
    codes = bytearray(n["codes"].numpy().tobytes())
    top = bytearray(codes)
    top[0], top[1] = 0x7F, top[1] | 0x80                # element 0: sign 0, exponent code 255
    negzero = bytearray(codes)
    negzero[0], negzero[1] = 0x80, negzero[1] & 0x7F    # element 0: sign 1, exponent code 0
    cases += [(nc, "exponent 255", {"codes": torch.tensor(list(top), dtype=torch.uint8)}, 8),
              (nc, "negative zero", {"codes": torch.tensor(list(negzero), dtype=torch.uint8)}, 8)]
    for c, dtype in ((Float16(), torch.float16), (BFloat16(), torch.bfloat16)):
        v = _valid(c)["v"]
        other = torch.bfloat16 if dtype == torch.float16 else torch.float16
        for label, val in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
            bad = v.clone()
            bad[5] = val
            cases.append((c, f"v {label}", {"v": bad}, 13))
        cases += [(c, label, parts, 13) for label, parts in (
            ("v missing", {}), ("v float32", {"v": v.float()}), ("v other 16-bit", {"v": v.to(other)}),
            ("v short", {"v": v[:-1]}), ("v 2-D", {"v": v.reshape(1, -1)}))]
    return cases


CASES = malformed_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name}-{label}" for c, label, _, _ in CASES])
def test_malformed_parts_raise_payload_error(case):
    c, label, parts, d = case
    out = c.decode(_valid(c, d), d)                     # the unmodified parts decode
    assert tuple(out.shape) == (d,)
    with pytest.raises(PayloadError):
        c.decode(parts, d)


def test_random_bytes_raise_only_payload_error():
    """Random codes of the right length decode to finite float32 or raise PayloadError."""
    rng = np.random.default_rng(7)
    decoded = refused = 0
    for c in (Sign(), ScaledSign(), StochasticRounding(bits=5), Natural(), Float16(), BFloat16()):
        for trial in range(60):
            d = int(rng.integers(1, 40))
            parts = _valid(c, d)
            for k, t in parts.items():
                raw = rng.integers(0, 256, size=t.numel() * t.element_size(), dtype=np.uint8)
                if trial % 2 == 0 or t.dim() == 0:      # half the trials: whole parts random, scalars too
                    parts[k] = torch.from_numpy(raw).view(t.dtype).reshape(t.shape).clone()
            try:
                out = c.decode(parts, d)
            except PayloadError:
                refused += 1
                continue
            decoded += 1
            assert out.dtype == torch.float32 and tuple(out.shape) == (d,) and bool(torch.isfinite(out).all())
    assert decoded > 50 and refused > 50
