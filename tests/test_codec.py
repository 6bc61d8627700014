"""Tensor codec: round trips for every dtype and shape, chunking, and rejection of bad payloads."""
from __future__ import annotations

import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.codec import (DTYPES, FRAME_OVERHEAD, PayloadError, check_tensors, decode_frames, encode,
                          make_envelope)
from fedhop.common.wire import fedhop_pb2 as pb


def env(**kw):
    base = dict(run_id="r1", round=3, src="server", dst="client-4", method="train")
    base.update(kw)
    return make_envelope(**base)


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2 ** 31)), min(info.max, 2 ** 31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (4, 7), (2, 3, 5, 1)])
def test_round_trip_every_dtype_and_shape(dtype_name, shape):
    dtype = DTYPES[dtype_name]
    try:
        t = sample_tensor(dtype, shape)
    except (RuntimeError, TypeError):
        pytest.skip(f"torch cannot sample {dtype_name}")
    enc = encode(Payload(tensors={"t": t}), env(), chunk_bytes=5)
    out = decode_frames(enc.frames).payload.tensors["t"]
    assert out.dtype == t.dtype and tuple(out.shape) == tuple(t.shape)
    as_bytes = lambda x: x.contiguous().reshape(-1).view(torch.uint8).tolist()  # noqa: E731
    assert as_bytes(out) == as_bytes(t)


def test_large_tensor_spans_many_chunks_and_bytes_are_counted():
    t = torch.randn(3_000_001)  # 12 MB, not a multiple of the chunk
    small = torch.arange(10, dtype=torch.int64)
    chunk = 1 << 20
    payload = Payload(tensors={"w": t, "idx": small}, scalars={"lr": 0.5, "n": 7, "flag": True, "tag": "x"})
    enc = encode(payload, env(), chunk_bytes=chunk)
    data_bytes = t.numel() * 4 + small.numel() * 8
    assert enc.tensor_bytes == data_bytes
    assert len(enc.frames) == 1 + -(-data_bytes // chunk)
    assert enc.payload_bytes == sum(len(f) for f in enc.frames)
    assert enc.framed_bytes == enc.payload_bytes + FRAME_OVERHEAD * len(enc.frames)
    dec = decode_frames(enc.frames)
    assert torch.equal(dec.payload.tensors["w"], t) and torch.equal(dec.payload.tensors["idx"], small)
    assert dec.payload.scalars == {"lr": 0.5, "n": 7, "flag": True, "tag": "x"}
    assert dec.payload_bytes == enc.payload_bytes and dec.envelope.round == 3


def test_frames_are_valid_protobuf_frames():
    enc = encode(Payload(tensors={"a": torch.ones(1000)}), env(), chunk_bytes=1024)
    first = pb.Frame.FromString(enc.frames[0])
    assert first.WhichOneof("body") == "header" and first.header.dst == "client-4"
    data = b"".join(pb.Frame.FromString(f).data for f in enc.frames[1:])
    assert data == torch.ones(1000).numpy().tobytes()


def test_decoded_tensors_are_views_of_one_buffer_not_copies():
    enc = encode(Payload(tensors={"a": torch.ones(100), "b": torch.zeros(50)}), env())
    out = decode_frames(enc.frames).payload.tensors
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()


def _tamper(frames, mutate):
    head = pb.Frame.FromString(frames[0]).header
    mutate(head)
    return [pb.Frame(header=head).SerializeToString(), *frames[1:]]


def test_rejects_wrong_byte_count():
    enc = encode(Payload(tensors={"a": torch.ones(10)}), env())
    frames = _tamper(enc.frames, lambda h: setattr(h.tensors[0], "nbytes", 44))
    with pytest.raises(PayloadError, match="SIZE_MISMATCH.*'a'"):
        decode_frames(frames)
    with pytest.raises(PayloadError, match="SIZE_MISMATCH"):
        decode_frames(enc.frames[:1])  # truncated: data frame missing


def test_rejects_unknown_dtype_and_bad_shape():
    enc = encode(Payload(tensors={"a": torch.ones(10)}), env())
    with pytest.raises(PayloadError, match="BAD_DTYPE.*'float128'"):
        decode_frames(_tamper(enc.frames, lambda h: setattr(h.tensors[0], "dtype", "float128")))
    with pytest.raises(PayloadError, match="SIZE_MISMATCH"):
        decode_frames(_tamper(enc.frames, lambda h: h.tensors[0].shape.__setitem__(0, 11)))


def test_rejects_huge_declared_size_before_allocating():
    enc = encode(Payload(tensors={"a": torch.ones(10)}), env())

    def huge(h):
        h.tensors[0].shape[0] = 10 ** 12
        h.tensors[0].nbytes = 4 * 10 ** 12
        h.data_bytes = 4 * 10 ** 12
    with pytest.raises(PayloadError, match="TOO_LARGE"):
        decode_frames(_tamper(enc.frames, huge), max_payload_bytes=1 << 30)


def test_rejects_garbage_frames():
    with pytest.raises(PayloadError, match="MALFORMED"):
        decode_frames([b"\x12\x05abc"])
    with pytest.raises(PayloadError, match="MALFORMED"):
        decode_frames([b"\x7f\x01a"])
    with pytest.raises(PayloadError, match="MALFORMED_HEADER"):
        decode_frames([b"\x0a\x03\xff\xff\xff"])


def test_check_tensors_names_the_problem():
    p = Payload(tensors={"w": torch.zeros(3)})
    check_tensors(p, {"w": (torch.float32, (3,))}, "reply")
    with pytest.raises(PayloadError, match="BAD_SHAPE.*'w'"):
        check_tensors(p, {"w": (torch.float32, (4,))}, "reply")
    with pytest.raises(PayloadError, match="BAD_DTYPE.*'w'"):
        check_tensors(p, {"w": (torch.float64, (3,))}, "reply")
    with pytest.raises(PayloadError, match="missing.*'v'"):
        check_tensors(p, {"v": (torch.float32, (3,))}, "reply")
