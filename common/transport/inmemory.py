"""In-memory transport for unit tests: the same codec and ledger, no sockets.

Calls run the callee's handler in the caller's thread on the frames the codec produced, so a
run gives the same bits and the same byte counts as over gRPC.
"""
from __future__ import annotations

import threading
import time

from fedhop.common.transport.base import CallFailed, Endpoint, Handler
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import Decoded, Encoded, FrameDecoder
from fedhop.common.wire.ledger import Ledger


class InMemoryNetwork:
    """Address book of the endpoints of one in-process run."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple["InMemoryEndpoint", Handler, object]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def attach(self, endpoint: "InMemoryEndpoint", handler: Handler, register_handler) -> str:
        with self._lock:
            self._next += 1
            address = f"mem:{endpoint.node_id}:{self._next}"
            self._nodes[address] = (endpoint, handler, register_handler)
            return address

    def detach(self, address: str) -> None:
        with self._lock:
            self._nodes.pop(address, None)

    def lookup(self, address: str):
        with self._lock:
            node = self._nodes.get(address)
        if node is None:
            raise CallFailed("UNAVAILABLE", f"no endpoint at {address}", address)
        return node


class InMemoryEndpoint(Endpoint):
    def __init__(self, network: InMemoryNetwork, node_id: str, ledger: Ledger, **kwargs) -> None:
        super().__init__(node_id, ledger, **kwargs)
        self.network = network
        self.address = ""

    def _exchange(self, address: str, request: Encoded, timeout: float,
                  decoder: FrameDecoder) -> tuple[Decoded, float]:
        target, handler, _ = self.network.lookup(address)
        started = time.perf_counter()
        reply_frames = target.serve_frames(list(request.frames), handler)
        sent = time.perf_counter() - started
        for frame in reply_frames:
            decoder.feed(frame)
        return decoder.finish(), sent

    def _register_rpc(self, address: str, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:
        target, _, register_handler = self.network.lookup(address)
        if register_handler is None:
            raise CallFailed("UNIMPLEMENTED", "peer accepts no registrations", address)
        return target.handle_registration(register_handler, pb.RegisterRequest.FromString(request.SerializeToString()))

    def heartbeat(self, address: str, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        target, _, _ = self.network.lookup(address)
        if target.liveness is None:
            raise CallFailed("UNIMPLEMENTED", "peer takes no heartbeats", address)
        return target.liveness.beat(pb.HeartbeatRequest.FromString(request.SerializeToString()))

    def serve(self, handler: Handler, bind: str = "", register_handler=None) -> str:
        self.address = self.network.attach(self, handler, register_handler)
        return self.address

    def stop(self) -> None:
        if self.address:
            self.network.detach(self.address)
            self.address = ""


def network_endpoint(node_id: str, ledger: Ledger, *, network: InMemoryNetwork | None = None,
                     **options) -> InMemoryEndpoint:
    """The registry's builder (common/transport/factory.py): an endpoint on `network`, which every
    endpoint of the run shares; without one there is nothing to reach (a process run uses grpc or torch)."""
    if network is None:
        raise ValueError("transport.kind = 'inmemory' runs a whole experiment in one process "
                         "(deploy/inmemory.py); a process run uses grpc or torch")
    return InMemoryEndpoint(network, node_id, ledger, **options)
