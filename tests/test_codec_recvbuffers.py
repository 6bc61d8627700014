"""Receive buffers reused across messages (common/wire/codec.py `RecvBuffers`): a large message's buffer
is handed out again only once nothing decoded from it is alive, and never changes a live tensor."""
from __future__ import annotations

import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import FrameDecoder, PayloadError, RecvBuffers, encode


def _frames(payload: Payload, chunk: int = 1 << 20) -> list[bytes]:
    return list(encode(payload, pb.Envelope(), chunk).frames)


def _decode(frames: list[bytes], pool: RecvBuffers) -> Payload:
    dec = FrameDecoder(buffers=pool)
    for f in frames:
        dec.feed(f)
    return dec.finish().payload


def _model(seed: int) -> Payload:
    g = torch.Generator().manual_seed(seed)
    return Payload(tensors={"w": torch.randn(600_000, generator=g), "b": torch.randn(7, generator=g).double(),
                            "i": torch.randint(0, 100, (5,), generator=g, dtype=torch.int64)})


def test_a_live_message_keeps_its_buffer_and_a_released_one_is_reused_bit_identically():
    pool = RecvBuffers(keep=3, min_bytes=1 << 20)
    first_model, second_model = _model(1), _model(2)
    first = _decode(_frames(first_model), pool)
    ptr = first.tensors["w"].data_ptr()
    second = _decode(_frames(second_model), pool)   # `first` is alive: a new buffer
    assert pool.reused == 0 and second.tensors["w"].data_ptr() != ptr
    for name, t in first_model.tensors.items():     # the live message is untouched by the second
        assert torch.equal(first.tensors[name], t) and first.tensors[name].dtype == t.dtype
    view = first.tensors["w"][10:20]                # a view keeps the buffer as well
    del first
    third = _decode(_frames(second_model), pool)
    assert pool.reused == 0 and third.tensors["w"].data_ptr() != ptr
    del view
    fourth = _decode(_frames(first_model), pool)    # now nothing holds the first buffer
    assert pool.reused == 1 and fourth.tensors["w"].data_ptr() == ptr
    for name, t in first_model.tensors.items():
        assert torch.equal(fourth.tensors[name], t)
    for name, t in second_model.tensors.items():    # the messages still alive kept their bytes
        assert torch.equal(second.tensors[name], t) and torch.equal(third.tensors[name], t)


def test_small_messages_and_other_sizes_get_new_buffers():
    pool = RecvBuffers(keep=2, min_bytes=1 << 20)
    small = Payload(tensors={"w": torch.ones(1000)})
    a = _decode(_frames(small), pool).tensors["w"].data_ptr()
    b = _decode(_frames(small), pool).tensors["w"].data_ptr()
    assert pool.reused == 0
    big = _decode(_frames(_model(3)), pool)
    del big
    other = _decode(_frames(Payload(tensors={"w": torch.randn(700_000)})), pool)   # another size
    assert pool.reused == 0 and other.tensors["w"].numel() == 700_000 and a and b


def test_a_corrupted_frame_into_a_reused_buffer_is_still_refused():
    pool = RecvBuffers(keep=1, min_bytes=1 << 20)
    model = _model(4)
    frames = _frames(model)
    first = _decode(frames, pool)
    del first
    bad = list(frames)
    flipped = bytearray(bad[2])
    flipped[len(flipped) // 2] ^= 0x01
    bad[2] = bytes(flipped)
    with pytest.raises(PayloadError) as exc:
        _decode(bad, pool)                          # the reused buffer, a corrupted byte: XXH3 refuses it
    assert exc.value.code == "CHECKSUM_MISMATCH" and pool.reused == 1
    again = _decode(frames, pool)                   # the buffer of the refused message is free again
    assert pool.reused == 2 and all(torch.equal(again.tensors[n], t) for n, t in model.tensors.items())


def test_a_short_message_never_shows_the_previous_bytes():
    pool = RecvBuffers(keep=1, min_bytes=1 << 20)
    model = _model(5)
    frames = _frames(model)
    del _decode(frames, pool).tensors
    dec = FrameDecoder(buffers=pool)
    for f in frames[:-2]:                           # the last data frame (and the trailer) never arrive
        dec.feed(f)
    with pytest.raises(PayloadError) as exc:
        dec.finish()
    assert exc.value.code == "SIZE_MISMATCH"
    dec = FrameDecoder(buffers=pool)
    for f in frames[:-1]:                           # every data byte, the trailer missing: not verified
        dec.feed(f)
    with pytest.raises(PayloadError) as exc:
        dec.finish()
    assert exc.value.code == "CHECKSUM_MISMATCH"
