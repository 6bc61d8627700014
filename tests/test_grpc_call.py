"""The gRPC transport's two call shapes (common/transport/grpc.py) between two endpoints on real
loopback sockets: a request of at most one chunk goes as `Call` (its frames bundled in one unary
request), a larger one as the `Exchange` stream; the ledger's framed bytes follow each shape's
wire layout exactly, and a malformed bundle gets a typed error reply."""
from __future__ import annotations

import grpc
import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.transport.grpc import CALL, GrpcEndpoint
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import FRAME_OVERHEAD, FrameDecoder, bundle_framing
from fedhop.common.wire.ledger import Ledger

CHUNK = 64 << 10


@pytest.fixture()
def pair():
    seen: list[str] = []
    callee = GrpcEndpoint("client-0", Ledger(), chunk_bytes=CHUNK, max_message_bytes=1 << 20)

    def handler(request):
        seen.append(request.envelope.method)
        return Payload(tensors={"w": request.payload.tensors["w"] * 2}, scalars={"n": 1})

    address = callee.serve(handler, "127.0.0.1:0")
    caller = GrpcEndpoint("server", Ledger(), chunk_bytes=CHUNK, max_message_bytes=1 << 20)
    yield caller, callee, address, seen
    caller.stop()
    callee.stop()


@pytest.mark.parametrize("numel, shape", [(5000, "bundled"), (3 * CHUNK // 4, "streamed")])
def test_small_requests_are_bundled_large_ones_streamed_and_bytes_are_exact(pair, numel, shape):
    """20 KB of data (one chunk is 64 KB) goes bundled: its data frame's length takes a 3-byte
    varint, so the bundle's framing (5 + 2 + 4 + 2) differs from three streamed messages'
    (5 + 5 + 5: header, data, the 9-byte XXH3 trailer), and both ends' records show which way it
    went; 192 KB goes as 5 streamed frames (header, 3 data frames, trailer)."""
    caller, callee, address, seen = pair
    w = torch.arange(numel, dtype=torch.float32)
    reply = caller.call(address, "client-0", "train", Payload(tensors={"w": w}), round=1, timeout=10)
    assert torch.equal(reply.tensors["w"], 2 * w) and seen == ["train"]
    request = next(r for r in caller.ledger.records() if r.method == "train")
    received = next(r for r in callee.ledger.records() if r.method == "train")
    frames = 1 + -(-4 * numel // CHUNK) + 1                 # the header, data frames of <= CHUNK bytes, the trailer
    if shape == "bundled":
        # one gRPC message: 5 bytes of prefix, then per frame a field tag and a length varint
        data_frame = 1 + 3 + 4 * numel                       # tag, 3-byte length varint, the bytes
        trailer = 1 + 8                                      # tag, the fixed64 digest
        header = request.payload_bytes - data_frame - trailer
        assert header < 128                                  # its length varint is 1 byte
        assert request.framed_bytes == request.payload_bytes + FRAME_OVERHEAD + (1 + 1) + (1 + 3) + (1 + 1)
        assert request.framed_bytes == request.payload_bytes + bundle_framing([header, data_frame, trailer])
    else:
        assert request.framed_bytes == request.payload_bytes + FRAME_OVERHEAD * frames
    assert received.framed_bytes == request.framed_bytes and received.payload_bytes == request.payload_bytes


def test_a_malformed_bundle_gets_a_typed_error_reply(pair):
    _, _, address, _ = pair
    channel = grpc.insecure_channel(address)
    try:
        stub = channel.unary_stream(CALL, request_serializer=None, response_deserializer=None)
        frames = list(stub(b"\x0a\x05abc", timeout=10))          # a length that runs past the end
    finally:
        channel.close()
    decoder = FrameDecoder()
    for f in frames:
        decoder.feed(f)
    env = decoder.finish().envelope
    assert env.method == "error" and env.error.code == "MALFORMED_FRAME"


def test_bundle_layout_is_protobufs():
    from fedhop.common.wire.codec import bundle_bytes
    frames = [b"a" * 3, b"b" * 200, b"c" * 70_000]
    raw = bundle_bytes(frames)
    assert list(pb.FrameBundle.FromString(raw).frames) == frames
    assert len(raw) + FRAME_OVERHEAD == sum(map(len, frames)) + bundle_framing([len(f) for f in frames])
