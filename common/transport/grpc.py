"""gRPC transport: `Exchange` is a bidirectional stream of raw `Frame` bytes.

The frames are already valid protobuf `Frame` messages (common/codec.py builds them), so the
stream uses identity (de)serializers: gRPC moves our bytes without another protobuf pass.
Message-size limits are set on both the server and every channel; every call has a deadline.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from common.algorithms.base import Payload
from common.codec import Decoded, Encoded, FrameDecoder, PayloadError
from common.ledger import Ledger
from common.transport.base import CallFailed, Endpoint, Handler
from common.wire import fedhop_pb2 as pb

EXCHANGE = "/fedhop.Fedhop/Exchange"
REGISTER = "/fedhop.Fedhop/Register"


def grpc_options(max_message_bytes: int, server: bool = False) -> list[tuple[str, int]]:
    """Channel and server options.  Clients ping every 30 s so a dead peer is noticed during
    a long call; servers accept pings that often (their default minimum is 5 minutes, after
    which they answer GOAWAY "too_many_pings" and cut long calls)."""
    extra = [("grpc.http2.min_ping_interval_without_data_ms", 10_000),
             ("grpc.http2.min_time_between_pings_ms", 10_000)] if server else []
    return extra + [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.lookahead_bytes", 64 << 20),
        ("grpc.http2.max_frame_size", 16 << 20),
    ]


RegisterHandler = "Callable[[pb.RegisterRequest], pb.RegisterReply]"


class GrpcEndpoint(Endpoint):
    def __init__(self, node_id: str, ledger: Ledger, run_id: str = "", token: str = "",
                 chunk_bytes: int = 4 << 20, max_payload_bytes: int = 1 << 31,
                 max_message_bytes: int = 64 << 20, workers: int = 16) -> None:
        super().__init__(node_id, ledger, run_id, token, chunk_bytes, max_payload_bytes)
        if max_message_bytes < chunk_bytes + 1024:
            raise ValueError(f"transport.max_message_bytes ({max_message_bytes}) must exceed "
                             f"transport.chunk_bytes ({chunk_bytes}) plus the frame header")
        self.max_message_bytes = max_message_bytes
        self.workers = workers
        self._server: grpc.Server | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.register_handler = None

    # -- client side ----------------------------------------------------------------
    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = grpc.insecure_channel(address, options=grpc_options(self.max_message_bytes))
                self._channels[address] = ch
            return ch

    def _exchange(self, address: str, request: Encoded, timeout: float) -> tuple[Decoded, float]:
        stub = self.channel(address).stream_stream(EXCHANGE, request_serializer=None,
                                                   response_deserializer=None)
        started = time.perf_counter()
        sent = [0.0]

        def frames():
            yield from request.frames
            sent[0] = time.perf_counter() - started

        decoder = FrameDecoder(max_payload_bytes=self.max_payload_bytes)
        try:
            for frame in stub(frames(), timeout=timeout, wait_for_ready=False):
                decoder.feed(frame)
            return decoder.finish(), sent[0]
        except grpc.RpcError as exc:
            raise CallFailed(exc.code().name, exc.details() or "", request.envelope.dst) from None
        except PayloadError as exc:
            raise CallFailed("BAD_REPLY", str(exc), request.envelope.dst) from None

    def _register_rpc(self, address: str, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:
        stub = self.channel(address).unary_unary(
            REGISTER, request_serializer=pb.RegisterRequest.SerializeToString,
            response_deserializer=pb.RegisterReply.FromString)
        try:
            return stub(request, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise CallFailed(exc.code().name, exc.details() or "", address) from None

    # -- server side ----------------------------------------------------------------
    def serve(self, handler: Handler, bind: str, register_handler=None) -> str:
        """Serve Exchange (and Register when `register_handler` is given) on `bind` (host:port)."""
        endpoint = self

        def exchange(request_iterator, context):
            frames = list(request_iterator)
            yield from endpoint.serve_frames(frames, handler)

        def register(request: pb.RegisterRequest, context) -> pb.RegisterReply:
            if register_handler is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{endpoint.node_id} accepts no registrations")
            return register_handler(request)

        handlers = {
            "Exchange": grpc.stream_stream_rpc_method_handler(exchange),
            "Register": grpc.unary_unary_rpc_method_handler(
                register, request_deserializer=pb.RegisterRequest.FromString,
                response_serializer=pb.RegisterReply.SerializeToString),
        }
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers),
                             options=grpc_options(self.max_message_bytes, server=True))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fedhop.Fedhop", handlers),))
        port = server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"cannot bind gRPC server to {bind}")
        server.start()
        self._server = server
        host = bind.rsplit(":", 1)[0]
        return f"{host}:{port}"

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1)
            self._server = None
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
