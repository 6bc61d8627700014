"""Requests bounded by their method, the method and caller checked on the header frame before
any data is read (common/transport/admission.py `RequestGate`, common/wire/codec.py `FrameDecoder.admit`).

The unit tests feed frames to the decoder a server uses; the process tests are rows of the
attack suite (tests/attacks.py): a real server and client processes, an insider streaming a
512 MB request, the receiving process's peak memory (VmHWM) read from /proc.
"""
from __future__ import annotations

import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.transport.admission import EMPTY_REQUESTS, MODEL_COPIES, REQUEST_SLACK, RequestGate, request_bounds
from fedhop.common.transport.router import MethodRouter, Peers
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import FrameDecoder, PayloadError, encode
from fedhop.common.wire.methods import Method
from tests import attacks


def _frames(method: str, src: str, nbytes: int) -> list[bytes]:
    env = pb.Envelope(method=method, src=src, dst="client-proc0", run_id="r")
    return list(encode(Payload(tensors={"w": torch.zeros(nbytes // 4)}), env, 1 << 20, True).frames)


def _router() -> MethodRouter:
    router = MethodRouter("client-proc0", Peers("server"))
    router.register_all({Method.TRAIN: lambda r: Payload(), Method.PING: lambda r: Payload()})
    return router


def _feed(gate: RequestGate, frames: list[bytes]) -> FrameDecoder:
    decoder = FrameDecoder(admit=gate)
    for frame in frames:
        decoder.feed(frame)
    return decoder


@pytest.mark.parametrize("method,src,code", [("train", "client-proc9", "NOT_ALLOWED"),
                                             ("seq_round", "server", "UNKNOWN_METHOD"),
                                             ("no_such_method", "server", "UNKNOWN_METHOD")])
def test_refused_method_or_caller_stops_at_the_header(method, src, code):
    gate = RequestGate(_router)
    frames = _frames(method, src, 8 << 20)
    decoder = FrameDecoder(admit=gate)
    with pytest.raises(PayloadError) as err:
        decoder.feed(frames[0])   # the header frame alone is refused: no data buffer was allocated
    assert err.value.code == code and decoder.filled == 0 and gate.refused == 1
    assert decoder.envelope is not None and decoder.envelope.method == method   # routed: recorded and answered


def test_request_bounded_by_its_method():
    model, clients = 3 << 20, 5
    bound = request_bounds(model, clients)
    gate = RequestGate(_router, lambda: bound)
    # ping carries no tensors: a ping with data is refused on its header
    with pytest.raises(PayloadError) as err:
        _feed(gate, _frames("ping", "client-proc9", 4096)[:1])
    assert err.value.code == "TOO_LARGE"
    # train from the parent: up to MODEL_COPIES models plus the slack, not a byte more
    limit = MODEL_COPIES * model + REQUEST_SLACK
    assert bound(Method.TRAIN) == limit and bound(Method.STATE_SET) == MODEL_COPIES * clients * model + REQUEST_SLACK
    assert all(bound(m) == 0 for m in EMPTY_REQUESTS)
    ok = _feed(gate, _frames("train", "server", 1 << 20))
    assert ok.finish().tensor_bytes == 1 << 20
    env = pb.Envelope(method="train", src="server", dst="client-proc0", data_bytes=limit + 4)
    env.tensors.add(name="w", dtype="float32", shape=[(limit + 4) // 4], nbytes=limit + 4)
    with pytest.raises(PayloadError) as err:
        FrameDecoder(admit=gate).feed(pb.Frame(header=env).SerializeToString())
    assert err.value.code == "TOO_LARGE"


def test_process_serving_no_calls_refuses_every_header():
    seen = []
    gate = RequestGate(None, on_refused=lambda env, code, reason: seen.append((env.src, code)))
    with pytest.raises(PayloadError) as err:
        FrameDecoder(admit=gate).feed(_frames("train", "client-procH", 4096)[0])
    assert err.value.code == "UNKNOWN_METHOD" and seen == [("client-procH", "UNKNOWN_METHOD")]


@pytest.mark.parametrize("name,code", [("big_request_512MB", "UNKNOWN_METHOD"),
                                       ("big_ping_to_client_512MB", "TOO_LARGE")])
def test_big_authenticated_request_is_refused_unread(tmp_path, name, code):
    """The insider's 512 MB request: the run completes, the receiving process's peak memory grows
    by less than a quarter of the request (on the unbounded decoder it grew by all of it), and
    the refusal names the method's rule."""
    row = attacks.run_attack(tmp_path, name)
    assert attacks.ok(row), row
    assert row["figures"]["code"] == code
    assert row["figures"]["peak_growth"] < attacks.BIG_REQUEST // 4
