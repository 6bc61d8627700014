"""The sparsifiers of issue 47 (common/processors/compressors/sparse.py): top-k and threshold equal
an independent numpy reference, random-k equals numpy on the same permutation and is unbiased
within a stated bound, the bytes equal a closed form written here for each index format, and
every malformed part is a PayloadError."""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal

import numpy as np
import pytest
import torch

from fedhop.common.processors.compressors.base import nbytes
from fedhop.common.processors.compressors.sparse import (
    RandK,
    Threshold,
    TopK,
    encode_indices,
    index_bytes,
    varint_decode,
    varint_encode,
)
from fedhop.common.wire.codec import PayloadError

DIMS = (1, 2, 7, 1000, 4097)
VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# ----------------------------------------------------------------------------- numpy references
def np_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even on the upper 16 bits) -> float32, in numpy bits."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def np_cast(x: np.ndarray, values: str) -> np.ndarray:
    x = x.astype(np.float32)
    if values == "float16":
        return x.astype(np.float16).astype(np.float32)
    if values == "bfloat16":
        return np_bfloat16(x)
    return x


def np_count(d: int, ratio: float, k: int) -> int:
    if k > 0:
        return min(k, d)
    return max(1, int((Decimal(str(ratio)) * d).to_integral_value(rounding=ROUND_CEILING)))


def leb128_len(indices: list[int]) -> int:
    """Bytes of the delta-varint stream, by plain Python: first index, then gaps minus one."""
    return len(leb128_stream(indices))


def leb128_stream(indices: list[int]) -> bytes:
    out = bytearray()
    prev = -1
    for i in indices:
        t = i - prev - 1
        prev = i
        while True:
            byte, t = t & 0x7F, t >> 7
            out.append(byte | (0x80 if t else 0))
            if not t:
                break
    return bytes(out)


def closed_form(d: int, kept: list[int], values: str) -> int:
    """s_val * k + min(4 k, V(S), ceil(d / 8))."""
    k = len(kept)
    return VALUE_BYTES[values] * k + min(4 * k, leb128_len(kept), math.ceil(d / 8))


def held_out(d: int, seed: int) -> np.ndarray:
    """float32[d] with ties (values on a 0.1 grid) and some zeros."""
    r = np.random.default_rng(10_000 + seed)
    v = np.round(r.standard_normal(d), 1).astype(np.float32)
    v[r.random(d) < 0.1] = 0.0
    return v


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- references
@pytest.mark.parametrize("values", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("keys", [{"ratio": 0.01}, {"ratio": 0.3}, {"k": 5}, {"k": 10**9}])
def test_topk_equals_numpy(keys: dict, values: str) -> None:
    comp = TopK(values=values, **keys)
    for seed, d in enumerate(DIMS):
        v = held_out(d, seed)
        k = np_count(d, keys.get("ratio", 0.01), keys.get("k", 0))
        kept = np.sort(np.argsort(-np.abs(v), kind="stable")[:k])        # ties: lower index first
        want = np.zeros(d, np.float32)
        want[kept] = np_cast(v[kept], values)
        g = gen(seed)
        state = g.get_state()
        parts = comp.encode(torch.from_numpy(v), g)
        assert torch.equal(g.get_state(), state)                          # top-k draws nothing
        got = comp.decode(parts, d)
        assert got.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), want)
        assert comp.encoded_bytes(d, parts) == nbytes(parts) == closed_form(d, kept.tolist(), values)


@pytest.mark.parametrize("values", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("tau", [0.0, 1e-3, 0.5, 1.5, 100.0])
def test_threshold_equals_numpy(tau: float, values: str) -> None:
    comp = Threshold(threshold=tau, values=values)
    for seed, d in enumerate(DIMS):
        v = held_out(d, seed)
        kept = np.flatnonzero(np.abs(v) >= np.float32(tau))
        want = np.zeros(d, np.float32)
        want[kept] = np_cast(v[kept], values)
        parts = comp.encode(torch.from_numpy(v), gen(seed))
        np.testing.assert_array_equal(comp.decode(parts, d).numpy(), want)
        assert parts["val"].numel() == kept.size
        assert comp.encoded_bytes(d, parts) == nbytes(parts) == closed_form(d, kept.tolist(), values)
    assert Threshold(threshold=100.0).encode(torch.ones(5), gen(0))["val"].numel() == 0


@pytest.mark.parametrize("values", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("keys", [{"ratio": 0.01}, {"ratio": 0.5}, {"k": 3}, {"k": 10**9}])
def test_randk_equals_numpy_on_the_same_permutation(keys: dict, values: str) -> None:
    comp = RandK(values=values, **keys)
    for seed, d in enumerate(DIMS):
        v = held_out(d, seed)
        k = np_count(d, keys.get("ratio", 0.01), keys.get("k", 0))
        kept = np.sort(torch.randperm(d, generator=gen(seed))[:k].numpy())
        want = np.zeros(d, np.float32)
        want[kept] = np_cast(v[kept] * np.float32(d / k), values)
        parts = comp.encode(torch.from_numpy(v), gen(seed))
        np.testing.assert_array_equal(comp.decode(parts, d).numpy(), want)
        assert comp.encoded_bytes(d, parts) == nbytes(parts) == closed_form(d, kept.tolist(), values)
        again = comp.encode(torch.from_numpy(v), gen(seed))               # the seed decides every draw
        assert all(torch.equal(parts[p], again[p]) for p in parts)


def test_randk_is_unbiased_within_the_variance_bound() -> None:
    """Per coordinate |mean - v_i| <= 5 sqrt(Var_i / N), Var_i = (d/k - 1) v_i^2 (sparse.py (S2)),
    and the mean squared error within 10 % of (d/k - 1) ||v||^2."""
    d, k, n = 24, 6, 10_000
    comp = RandK(k=k)
    v = torch.from_numpy(np.random.default_rng(7).standard_normal(d).astype(np.float32))
    g = gen(123)
    total = torch.zeros(d, dtype=torch.float64)
    sq_err = 0.0
    for _ in range(n):
        out = comp.decode(comp.encode(v, g), d).to(torch.float64)
        total += out
        sq_err += float(((out - v.double()) ** 2).sum())
    mean = total / n
    var = (d / k - 1) * v.double() ** 2
    assert bool(((mean - v.double()).abs() <= 5 * torch.sqrt(var / n)).all())
    assert abs(sq_err / n / float(var.sum()) - 1.0) < 0.1
    assert RandK.unbiased and not TopK.unbiased and not Threshold.unbiased


# ----------------------------------------------------------------------------- bytes
def spikes(d: int, at: list[int]) -> torch.Tensor:
    v = torch.zeros(d)
    v[at] = torch.arange(1, len(at) + 1, dtype=torch.float32)
    return v


def test_each_index_format_wins_where_its_closed_form_is_smallest() -> None:
    # dense: k = ceil(d / 2) of d = 4097 -> bitmap, ceil(4097 / 8) = 513 bytes < 4 k = 8196
    d = 4097
    parts = TopK(ratio=0.5).encode(torch.from_numpy(held_out(d, 1)), gen(0))
    assert set(parts) == {"bitmap", "val"}
    assert TopK(ratio=0.5).encoded_bytes(d, parts) == nbytes(parts) == 4 * 2049 + 513
    # k = 3 of d = 10^6 spread out: terms 100000, 399999, 399999 are 3 LEB128 bytes each
    # (2^14 <= t < 2^21): idxvar 9 < idx32 12 < bitmap 125000
    at = [100_000, 500_000, 900_000]
    parts = TopK(k=3).encode(spikes(10**6, at), gen(0))
    assert set(parts) == {"idxvar", "val"}
    assert parts["idxvar"].numpy().tobytes() == leb128_stream(at)
    assert TopK(k=3).encoded_bytes(10**6, parts) == nbytes(parts) == 4 * 3 + 9
    # d = 10^7: terms 3000000, 2999999, 2999999 are 4 bytes each (2^21 <= t < 2^28): idxvar 12 =
    # idx32 12, and the tie goes to idx32
    at = [3_000_000, 6_000_000, 9_000_000]
    parts = TopK(k=3, values="float16").encode(spikes(10**7, at), gen(0))
    assert set(parts) == {"idx32", "val"} and parts["idx32"].dtype == torch.uint32
    assert parts["idx32"].numpy().tolist() == at
    assert TopK(k=3, values="float16").encoded_bytes(10**7, parts) == nbytes(parts) == 2 * 3 + 12
    # terms >= 2^28 take 5 bytes: idx32 wins outright (12 < 15), checked on the index parts of d = 2^32
    at = [2**29, 2**30 + 2**29, 2**31 + 2**30]
    assert leb128_len(at) == 15
    idx_parts = encode_indices(np.array(at), 2**32)
    assert set(idx_parts) == {"idx32"} and index_bytes(np.array(at), 2**32) == 12
    comp = TopK(k=3)
    vals = {"val": torch.ones(3)}
    assert comp.encoded_bytes(2**32, {**idx_parts, **vals}) == 4 * 3 + 12
    # a tie of bitmap and idxvar goes to bitmap: k = 1 of d = 8 is 1 byte either way; d = 9 needs a
    # 2-byte bitmap, so idxvar's 1 byte wins
    parts = TopK(k=1).encode(spikes(8, [5]), gen(0))
    assert set(parts) == {"bitmap", "val"} and parts["bitmap"].tolist() == [0x04]
    parts = TopK(k=1).encode(spikes(9, [5]), gen(0))
    assert set(parts) == {"idxvar", "val"} and parts["idxvar"].tolist() == [5]
    assert TopK(k=1).encoded_bytes(9, parts) == nbytes(parts) == 4 + 1
    # k = 0 (threshold above every |v_i|): an empty idx32 and val, 0 bytes
    parts = Threshold(threshold=10.0).encode(torch.ones(100), gen(0))
    assert {p: t.numel() for p, t in parts.items()} == {"idx32": 0, "val": 0}
    assert Threshold(threshold=10.0).encoded_bytes(100, parts) == nbytes(parts) == 0


def test_varint_stream_is_gaps_minus_one_leb128() -> None:
    r = np.random.default_rng(3)
    for d in (1, 5, 200, 70_000, 3_000_000):
        for k in sorted({0, 1, min(d, 2), min(d, 50)}):
            idx = np.sort(r.choice(d, size=k, replace=False))
            stream = varint_encode(idx)
            assert stream.dtype == np.uint8 and stream.tobytes() == leb128_stream(idx.tolist())
            np.testing.assert_array_equal(varint_decode(stream, d, k), idx)
            assert index_bytes(idx, d) == min(4 * k, len(stream), math.ceil(d / 8))


# ----------------------------------------------------------------------------- values and keys
def test_values_saturate_and_round_like_numpy() -> None:
    """Casts round to nearest even as numpy does; a finite value beyond the dtype's range becomes its
    largest finite value (float16 65504, bfloat16 0x7F7F) instead of an inf the receiver rejects."""
    v = torch.tensor([1e6, -7e4, 65519.0, 0.1, 3.3e38, -3.4e38], dtype=torch.float32)
    half = TopK(k=6, values="float16")
    got = half.decode(half.encode(v, gen(0)), 6).numpy()
    np.testing.assert_array_equal(got, np.array([65504, -65504, 65504, np.float16(0.1), 65504, -65504], np.float32))
    bf = TopK(k=6, values="bfloat16")
    got = bf.decode(bf.encode(v, gen(0)), 6).numpy()
    bf_max = np.array([0x7F7F0000], np.uint32).view(np.float32)[0]
    np.testing.assert_array_equal(got[:5], np_bfloat16(v.numpy()[:5]))       # 3.3e38 rounds, below the max
    assert np.isinf(np_bfloat16(v.numpy()[5:]))[0]                           # a plain cast would overflow
    assert -got[5] == bf_max == float(torch.finfo(torch.bfloat16).max)


def test_count_rule_and_bad_keys() -> None:
    assert TopK(ratio=0.07).count(100) == 7          # not the 8 of float 0.07 * 100
    assert TopK().count(5) == 1 and TopK().count(1000) == 10 and TopK().count(1001) == 11
    assert RandK(k=9).count(4) == 4 and RandK(ratio=1.0).count(33) == 33
    for bad in ({"ratio": 0.0}, {"ratio": 1.5}, {"k": -1}, {"values": "int8"}):
        with pytest.raises(ValueError):
            TopK(**bad)
    for bad_t in ({"threshold": -1.0}, {"threshold": math.inf}, {"values": "float64"}):
        with pytest.raises(ValueError):
            Threshold(**bad_t)
    with pytest.raises(ValueError):
        TopK().encode(torch.zeros(2, 2), gen(0))


# ----------------------------------------------------------------------------- malformed parts
def _bad_cases() -> list[tuple[str, object, int, dict]]:
    """(label, compressor, d, parts) of each kind of malformed part."""
    topk, thr = TopK(k=3), Threshold(threshold=0.5)
    d_var = 10**6
    good_var = topk.encode(spikes(d_var, [100_000, 500_000, 900_000]), gen(0))      # idxvar
    good_bm = TopK(k=4).encode(spikes(16, [1, 5, 9, 12]), gen(0))                   # bitmap
    good_32 = topk.encode(spikes(10**7, [3_000_000, 6_000_000, 9_000_000]), gen(0))  # idx32
    val3 = good_var["val"]
    u8 = lambda xs: torch.tensor(xs, dtype=torch.uint8)                             # noqa: E731
    u32 = lambda xs: torch.from_numpy(np.array(xs, np.uint32))                      # noqa: E731
    return [
        ("missing val", topk, d_var, {"idxvar": good_var["idxvar"]}),
        ("missing index", topk, d_var, {"val": val3}),
        ("two index parts", topk, d_var, {**good_var, "idx32": u32([1, 2, 3])}),
        ("unknown part", topk, d_var, {**good_var, "extra": u8([0])}),
        ("val dtype", topk, d_var, {**good_var, "val": val3.double()}),
        ("val length", topk, d_var, {**good_var, "val": torch.ones(4)}),
        ("val 2-D", topk, d_var, {**good_var, "val": val3.reshape(3, 1)}),
        ("val nan", topk, d_var, {**good_var, "val": torch.tensor([1.0, math.nan, 2.0])}),
        ("val inf", topk, d_var, {**good_var, "val": torch.tensor([1.0, math.inf, 2.0])}),
        ("idx32 dtype int32", topk, 10**7, {**good_32, "idx32": torch.tensor([3_000_000, 6_000_000, 9_000_000],
                                                                                 dtype=torch.int32)}),
        ("idx32 dtype int64", topk, 10**7, {**good_32, "idx32": torch.tensor([3_000_000, 6_000_000, 9_000_000])}),
        ("idx32 unsorted", topk, 10**7, {**good_32, "idx32": u32([6_000_000, 3_000_000, 9_000_000])}),
        ("idx32 duplicate", topk, 10**7, {**good_32, "idx32": u32([3_000_000, 3_000_000, 9_000_000])}),
        ("idx32 beyond d", topk, 10**7, {**good_32, "idx32": u32([3_000_000, 6_000_000, 10**7])}),
        ("idx32 length", topk, 10**7, {**good_32, "idx32": u32([3_000_000, 6_000_000])}),
        ("idx32 not smallest", topk, d_var, {"val": val3, "idx32": u32([100_000, 500_000, 900_000])}),
        ("idxvar overrun", topk, d_var, {**good_var, "idxvar": u8([0x81, 0x80])}),
        ("idxvar too many", topk, d_var, {**good_var, "idxvar": u8([1, 1, 1, 1])}),
        ("idxvar too few", topk, d_var, {**good_var, "idxvar": u8([1, 1])}),
        ("idxvar beyond d", topk, d_var, {**good_var, "idxvar": u8([0xC0, 0x84, 0x3D, 0, 0])}),   # 10^6, 10^6+1, ...
        ("idxvar not minimal", topk, d_var, {**good_var, "idxvar": u8([0x80, 0x00, 1, 1])}),
        ("idxvar 6 bytes", topk, d_var, {**good_var, "idxvar": u8([0x80] * 5 + [1, 0, 0])}),
        ("idxvar too long", topk, d_var, {**good_var, "idxvar": u8([0] * 13)}),
        ("idxvar dtype", topk, d_var, {**good_var, "idxvar": good_var["idxvar"].to(torch.int8)}),
        ("idxvar 2-D", topk, d_var, {**good_var, "idxvar": good_var["idxvar"].reshape(1, -1)}),
        ("idxvar not smallest", TopK(k=4), 16, {"val": good_bm["val"], "idxvar": u8([1, 3, 3, 2])}),
        ("bitmap popcount", TopK(k=4), 16, {**good_bm, "bitmap": u8([0x44, 0x89])}),
        ("bitmap length", TopK(k=4), 16, {**good_bm, "bitmap": u8([0x44, 0x88, 0x00])}),
        ("bitmap dtype", TopK(k=4), 16, {**good_bm, "bitmap": good_bm["bitmap"].to(torch.int16)}),
        ("bitmap padding bit", TopK(k=2), 12, {"val": torch.ones(2), "bitmap": u8([0x80, 0x08])}),
        ("bitmap not smallest", TopK(k=1), 100, {"val": torch.ones(1), "bitmap": u8([0x80] + [0] * 12)}),
        ("threshold count", thr, 16, {**good_bm, "val": torch.ones(3)}),
        ("threshold val too long", thr, 4, {"val": torch.ones(5), "bitmap": u8([0xF0])}),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_malformed_part_is_a_payload_error(case: tuple) -> None:
    _, comp, d, parts = case
    with pytest.raises(PayloadError):
        comp.decode(parts, d)


def test_good_cases_of_the_fuzz_decode() -> None:
    """The unmutated parts the malformed cases start from decode (so each case fails by its mutation)."""
    assert TopK(k=3).decode(TopK(k=3).encode(spikes(10**6, [100_000, 500_000, 900_000]), gen(0)), 10**6)[500_000] == 2
    parts = TopK(k=4).encode(spikes(16, [1, 5, 9, 12]), gen(0))
    assert parts["bitmap"].tolist() == [0x44, 0x48]
    assert Threshold(threshold=0.5).decode(parts, 16).tolist()[12] == 4.0


def test_random_bytes_never_raise_anything_but_payload_error() -> None:
    r = np.random.default_rng(11)
    comps = [TopK(k=5), RandK(k=5, values="float16"), Threshold(threshold=0.1, values="bfloat16")]
    accepted = 0
    for trial in range(3000):
        comp = comps[trial % 3]
        d = int(r.integers(1, 400))
        k = comp.count(d) if not isinstance(comp, Threshold) else int(r.integers(0, d + 1))
        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[comp.values]
        val = torch.from_numpy(r.standard_normal(k).astype(np.float32)).to(dtype)
        fmt = ("idx32", "idxvar", "bitmap")[trial % 7 % 3]
        if fmt == "bitmap":
            raw = torch.from_numpy(r.integers(0, 256, (d + 7) // 8, dtype=np.uint8))
        elif fmt == "idxvar":
            raw = torch.from_numpy(r.integers(0, 256, int(r.integers(0, 2 * k + 2)), dtype=np.uint8))
        else:
            raw = torch.from_numpy(np.sort(r.integers(0, d + 2, k).astype(np.uint32)))
        parts = {"val": val, fmt: raw}
        try:
            out = comp.decode(parts, d)
        except PayloadError:
            continue
        accepted += 1
        assert out.shape == (d,) and int((out != 0).sum()) <= k
        assert comp.encoded_bytes(d, parts) == nbytes(parts)
    assert accepted > 0


def test_parts_cross_the_wire_codec_with_their_formula_bytes() -> None:
    """Each index format (uint32 included) survives fedhop's codec bit for bit, and the codec's
    tensor bytes are the formula's."""
    from fedhop.common.wire import codec
    from fedhop.common.wire.message import Payload

    cases = [(TopK(k=3, values="bfloat16"), 10**7, spikes(10**7, [3_000_000, 6_000_000, 9_000_000])),   # idx32
             (RandK(ratio=0.01, values="float16"), 10**5, torch.from_numpy(held_out(10**5, 4))),         # idxvar
             (Threshold(threshold=0.5), 4097, torch.from_numpy(held_out(4097, 5)))]                     # bitmap
    formats = set()
    for comp, d, v in cases:
        parts = comp.encode(v, gen(1))
        formats |= set(parts) - {"val"}
        sent = Payload(tensors={f"{comp.name}.{p}:w": t for p, t in parts.items()})
        enc = codec.encode(sent, codec.make_envelope(run_id="r", round=1, src="a", dst="b", method="train"))
        assert enc.tensor_bytes == comp.encoded_bytes(d, parts)
        got = codec.decode_frames([bytes(f) for f in enc.frames]).payload.tensors
        back = {name.split(".", 1)[1].split(":")[0]: t for name, t in got.items()}
        assert all(back[p].dtype == parts[p].dtype and torch.equal(back[p], parts[p]) for p in parts)
        assert torch.equal(comp.decode(back, d), comp.decode(parts, d))
    assert formats == {"idx32", "idxvar", "bitmap"}
