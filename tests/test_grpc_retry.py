"""A call that fails before any byte of its request was delivered is tried again within its
deadline (common/transport/grpc.py): forced by a real listener that accepts connections and closes
them at once; the ledger holds only the attempt that put the request on the wire."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from fedhop.common.algorithms.base import Payload
from fedhop.common.transport.base import CallFailed
from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.wire.ledger import Ledger
from tests.netfault import FaultProxy


@pytest.fixture()
def callee():
    seen: list[int] = []
    ep = GrpcEndpoint("client-0", Ledger())

    def handler(request):
        seen.append(request.envelope.round)
        return Payload(tensors={"w": request.payload.tensors["w"] + 1})

    address = ep.serve(handler, "127.0.0.1:0")
    yield ep, address, seen
    ep.stop()


@pytest.mark.parametrize("refused", [1, 2])
def test_refused_connections_are_retried_and_only_the_real_attempt_is_recorded(callee, refused):
    ep, address, seen = callee
    proxy = FaultProxy(address, mode="pass", refuse_first=refused)
    caller = GrpcEndpoint("server", Ledger())
    try:
        w = torch.arange(6, dtype=torch.float32)
        reply = caller.call(proxy.address, "client-0", "train", Payload(tensors={"w": w}), round=3, timeout=20)
        assert torch.equal(reply.tensors["w"], w + 1)
        assert proxy.refused == refused                      # the listener refused that many connections
        assert caller.retries >= 1 and seen == [3]           # retried; the handler ran once
        sent = [r for r in caller.ledger.records() if r.method == "train"]
        got = [r for r in ep.ledger.records() if r.method == "train"]
        assert len(sent) == 1 and sent[0].status == "ok" and sent[0].role == "sender"
        assert len(got) == 1 and got[0].msg_id == sent[0].msg_id and got[0].framed_bytes == sent[0].framed_bytes
        replies = [r for r in caller.ledger.records() if r.method == "train.reply"]
        assert len(replies) == 1 and replies[0].status == "ok"
    finally:
        caller.stop()
        proxy.close()


def test_a_peer_that_never_accepts_fails_within_the_deadline():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                                # nothing listens: connection refused
    caller = GrpcEndpoint("server", Ledger())
    try:
        started = time.perf_counter()
        with pytest.raises(CallFailed) as exc:
            caller.call(f"127.0.0.1:{port}", "client-0", "train", Payload(tensors={"w": torch.ones(3)}),
                        round=1, timeout=2.0)
        elapsed = time.perf_counter() - started
        assert exc.value.code == "UNAVAILABLE"
        assert caller.retries >= 2 and elapsed < 2.0 + 1.0   # backed off and retried, gave up by the deadline
        lost = [r for r in caller.ledger.records() if r.method == "train"]
        assert len(lost) == 1 and lost[0].status == "lost"   # the call's one outcome, as before
        assert lost[0].framed_bytes == lost[0].payload_bytes == lost[0].tensor_bytes == 0   # nothing crossed
    finally:
        caller.stop()


def test_an_address_that_gave_up_fails_at_once_until_a_call_succeeds(callee):
    """A dead peer costs one retry window, not one per call; once it answers, retries resume."""
    ep, address, seen = callee
    proxy = FaultProxy(address, mode="pass", refuse_first=10_000)   # refuses every connection for now
    caller = GrpcEndpoint("server", Ledger())
    w = {"w": torch.ones(3)}
    try:
        started = time.perf_counter()
        with pytest.raises(CallFailed):
            caller.call(proxy.address, "client-0", "train", Payload(tensors=w), round=1, timeout=30)
        first = time.perf_counter() - started
        retries = caller.retries
        assert retries >= 2 and first < 4.0 + 2.0                # the retry window, not the 30 s deadline
        started = time.perf_counter()
        with pytest.raises(CallFailed):
            caller.call(proxy.address, "client-0", "train", Payload(tensors=w), round=2, timeout=30)
        assert caller.retries == retries and time.perf_counter() - started < 1.0   # no retry now
        proxy.refuse_first = 0                                   # the peer is back
        caller.mark_alive(proxy.address)
        caller.call(proxy.address, "client-0", "train", Payload(tensors=w), round=3, timeout=30)
        assert seen == [3]
    finally:
        caller.stop()
        proxy.close()


def test_a_new_endpoint_does_not_inherit_another_ones_failed_connection():
    """gRPC shares one connection per address across a process's channels unless told otherwise:
    an endpoint whose channel failed against a stopped server left a later endpoint (a restarted
    role, a test's next cluster) the failure's last error until its backoff ended, even with a
    new server at the address.  Each endpoint's channel now connects on its own."""
    from fedhop.common.wire import fedhop_pb2 as pb

    request = pb.RegisterRequest(node_id="client-proc0", role="client", address="127.0.0.1:1")
    first = GrpcEndpoint("server", Ledger())
    address = first.serve(lambda req: None, "127.0.0.1:0", register_handler=lambda *a: pb.RegisterReply())
    earlier = GrpcEndpoint("client-proc0", Ledger())
    later = GrpcEndpoint("client-proc0", Ledger())
    second = GrpcEndpoint("server", Ledger())
    try:
        assert earlier.register(address, request, 5.0).node_id == "server"
        first.stop(grace=0.1)
        with pytest.raises(CallFailed):   # the earlier channel's connection is now in its backoff
            earlier.register(address, request, 1.0)
        assert second.serve(lambda req: None, address, register_handler=lambda *a: pb.RegisterReply()) == address
        assert later.register(address, request, 5.0).node_id == "server"   # its own connection: at once
    finally:
        for ep in (earlier, later, second):
            ep.stop(grace=0.1)
