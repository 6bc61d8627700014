"""Identity and admission (issue 17, item 3): a live node id cannot be taken over, every
registration refusal is an event, refusals are aggregated per peer, unauthenticated requests
are bounded before they are read."""
from __future__ import annotations

import grpc
import pytest

from fedhop.common.transport.admission import EventThrottle, peer_host, takeover_refusal
from fedhop.common.transport.grpc import GrpcEndpoint, grpc_options
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger
from tests.cluster import Cluster
from tests.test_hostile import _cfg


def _register(address: str, node_id: str, ids, advertise: str | None = None) -> pb.RegisterReply:
    """Register `node_id` with the parent at `address`, claiming `advertise`, or (None) the address
    this endpoint serves at, which it then proves (the parent's probe)."""
    ep = GrpcEndpoint(node_id, Ledger())
    try:
        own = ep.serve(lambda request: None, "127.0.0.1:0") if advertise is None else advertise
        return ep.register(address, pb.RegisterRequest(node_id=node_id, role="client", address=own,
                                                       clients=[pb.LogicalClient(client_id=c) for c in ids]), 10.0)
    finally:
        ep.stop(grace=0.1)


def test_a_live_node_id_is_not_taken_over_and_every_refusal_is_an_event(tmp_path):
    cluster = Cluster(_cfg(), tmp_path)
    try:
        real = cluster.add_client("client-proc0", [0, 1])
        cluster.add_client("client-proc1", [2, 3])
        taken = _register(cluster.address, "client-proc0", [0, 1], "127.0.0.1:9")   # same id, other address
        assert not taken.accepted and taken.message.startswith("NODE_TAKEN"), taken.message
        assert cluster.coord.children["client-proc0"].address == real.address   # still the real process
        out_of_range = _register(cluster.address, "client-procX", [99])
        assert not out_of_range.accepted and "out of range" in out_of_range.message
        duplicate = _register(cluster.address, "client-procY", [2])
        assert not duplicate.accepted and duplicate.message.startswith("DUPLICATE_CLIENT")
        summary = cluster.run()
    finally:
        cluster.close()
    assert summary["status"] == "completed", summary["error"]
    events = {e["node"]: e["detail"] for e in cluster.store().events("register_refused")}
    assert set(events) == {"client-proc0", "client-procX", "client-procY"}, events
    assert "NODE_TAKEN" in events["client-proc0"] and "out of range" in events["client-procX"]
    assert "DUPLICATE_CLIENT" in events["client-procY"]


def test_refusals_are_one_event_per_peer_per_interval_with_a_count():
    now = [0.0]
    got: list[tuple[str, str, str]] = []
    throttle = EventThrottle(lambda k, n, d: got.append((k, n, d)), interval=10.0, clock=lambda: now[0])
    for i in range(2000):
        throttle("auth_refused", "ipv4:10.0.0.5", f"n{i}", "wrong token")
    throttle("auth_refused", "ipv4:10.0.0.6", "m", "wrong token")
    assert len(got) == 2
    now[0] = 11.0
    throttle("auth_refused", "ipv4:10.0.0.5", "late", "wrong token")
    assert len(got) == 3 and got[-1][2].endswith("(+1999 more from ipv4:10.0.0.5 within 10s)")
    throttle("auth_refused", "ipv4:10.0.0.5", "again", "wrong token")
    throttle.flush()
    assert got[-1] == ("auth_refused", "again", "wrong token (+1 more from ipv4:10.0.0.5 within 10s)")
    assert peer_host("ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1" and peer_host("ipv6:[::1]:80") == "ipv6:[::1]"


def test_takeover_rule():
    assert takeover_refusal("client-proc0", "h:1", None) is None          # unknown or dead: may register
    assert takeover_refusal("client-proc0", "h:1", "h:1") is None         # a retried registration
    assert takeover_refusal("client-proc0", "h:2", "h:1").startswith("NODE_TAKEN")


def test_a_request_larger_than_a_frame_is_refused_before_it_is_read():
    """A server's receive bound is one frame (chunk_bytes + 1 MiB), not max_message_bytes."""
    ep = GrpcEndpoint("server", Ledger(), chunk_bytes=1 << 20, max_message_bytes=64 << 20)
    address = ep.serve(lambda req: None, "127.0.0.1:0")
    try:
        assert ep.request_bound() == 2 << 20
        channel = grpc.insecure_channel(address, options=grpc_options(128 << 20))
        call = channel.unary_unary("/fedhop.Fedhop/Register", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            call(b"\x0a" + b"\xff" * (8 << 20), timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel.close()
    finally:
        ep.stop()


def test_an_unauthenticated_call_is_refused_unread_and_aggregated_per_peer():
    """Under node tokens, a call without a valid token is refused from its metadata before its
    message is read: a 60 MB body (far over the 2 MiB receive bound, which gRPC would answer
    RESOURCE_EXHAUSTED once it had the length prefix) is answered UNAUTHENTICATED, and the
    refusals reach `on_refused` with the peer, where the server's EventThrottle folds them into
    one `auth_refused` event per peer host with a count."""
    from fedhop.common.security.auth import NodeCredentials
    events: list[tuple[str, str, str]] = []
    throttle = EventThrottle(lambda k, n, d: events.append((k, n, d)), interval=3600.0)

    def refused(node: str, method: str, reason: str, peer: str) -> None:
        throttle("auth_refused", peer_host(peer), node or "?", f"{method} from {peer}: {reason}")

    ep = GrpcEndpoint("server", Ledger(), chunk_bytes=1 << 20, max_message_bytes=64 << 20,
                      credentials=NodeCredentials("server", b"cluster-secret"), on_refused=refused)
    address = ep.serve(lambda req: None, "127.0.0.1:0")
    channel = grpc.insecure_channel(address, options=grpc_options(128 << 20))
    try:
        body = b"\x0a" + b"\x00" * (60 << 20)
        codes = []
        for method in ("Register", "Call", "Heartbeat", "Register"):
            call = channel.unary_unary(f"/fedhop.Fedhop/{method}", request_serializer=None,
                                       response_deserializer=None)
            with pytest.raises(grpc.RpcError) as exc:
                call(body, timeout=30)
            codes.append(exc.value.code())
        wrong = channel.unary_unary("/fedhop.Fedhop/Register", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            wrong(body, timeout=30, metadata=(("fedhop-node", "client-proc0"), ("fedhop-auth", "forged")))
        codes.append(exc.value.code())
    finally:
        channel.close()
        ep.stop()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 5, codes
    assert len(events) == 1 and events[0][0] == "auth_refused" and "no node credential" in events[0][2]
    throttle.flush()
    assert len(events) == 2 and events[1][2].endswith("(+4 more from ipv4:127.0.0.1 within 3600s)"), events
