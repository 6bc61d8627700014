"""In-memory transport for unit tests: the same codec and ledger, no sockets.

Calls run the callee's handler in the caller's thread on the frames the codec produced, so a
run gives the same bits and the same byte counts as over gRPC.  The ledger's framed bytes are
gRPC's (common/transport/grpc.py), decided by the same helpers (common/transport/base.py,
framing): a request of at most one chunk counts the framing of its one-`Call` bundle, a pulled
request its go message, a batch (`call_many`) shares one bundle's framing among its messages,
and every reply frame counts 5 bytes, as a streamed reply does.

Registrations carry a fresh key and the parent probes the address they claim, as over gRPC
(grpc.py module docstring, Addresses proved): the probe is a call on the network to the endpoint
attached there, and both ends record the same `probe` and `probe.reply` control messages.
Heartbeats are answered but, unlike gRPC's, not recorded.

An endpoint may have a `serve_lock` (the in-process engine gives one lock to every client
process it serves in its own process, deploy/launch/inprocess.py): calls to it are served one at a
time, a batch's requests all under one hold.  Every caller is a thread of one Python process, so
callees that take turns do the same work as callees that run at once, without the threads
passing the interpreter lock back and forth between each other's Python and torch steps.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Sequence

from fedhop.common.transport.admission import REGISTRATION_KEYS
from fedhop.common.transport.base import (
    Batched,
    CallFailed,
    Endpoint,
    Handler,
    RegisterHandler,
    ReplyBundles,
    _Taken,
    one_by_one,
    pulls_reply,
    request_framing,
    shares_one_call,
)
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import Decoded, Encoded, FrameDecoder
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import message_link


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
        self.serve_lock: threading.RLock | None = None   # calls served one at a time (module docstring)
        self._ahead: dict[bytes, _Taken] = {}   # a batch's requests decoded ahead (`pipelined`), by header frame

    def serving(self) -> contextlib.AbstractContextManager[object]:
        """Held while this endpoint serves a call or a batch (`serve_lock`); a no-op without one."""
        return self.serve_lock if self.serve_lock is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def pipelined(self, messages: Sequence[Encoded]) -> Iterator[None]:
        """A batch's requests (`call_many`) shown to `before_batch` before the first is served, as
        `Endpoint.serve_batch` shows a gRPC batch's: under [algorithm] vectorized a client
        process trains the batch's clients together (client/host.py `prepare_batch`).  Each
        request is then served on its own, from the form it was decoded in here (`serve_frames`:
        not decoded, or moved to the device, again); nothing is recorded here."""
        if self.before_batch is None:
            yield
            return
        frames = [list(m.frames) for m in messages]
        taken: list[_Taken | None] = [self._take(fs, m.framing, False, None, []) for fs, m in zip(frames, messages)]
        self._tell_batch(taken)
        ahead = {bytes(fs[0]): t for fs, t in zip(frames, taken) if fs and t is not None}
        self._ahead.update(ahead)
        try:
            yield
        finally:   # a request no call served (its call failed first) is forgotten with the batch
            for key in ahead:
                self._ahead.pop(key, None)

    def serve_frames(self, frames, handler: Handler, framing: int | None = None, pulled: bool = False,
                     on_header: Callable[[pb.Envelope], Callable[[], None] | None] | None = None,
                     reply_framing: Callable[[list[int]], int] | None = None) -> Sequence[bytes]:
        """`Endpoint.serve_frames`; a request of a batch decoded ahead (`pipelined`) is answered
        from that decoding."""
        if self._ahead and frames and not pulled and on_header is None:
            taken = self._ahead.pop(bytes(frames[0]), None)
            if taken is not None:
                return self._answer(taken, handler, reply_framing)
        return super().serve_frames(frames, handler, framing=framing, pulled=pulled, on_header=on_header,
                                    reply_framing=reply_framing)

    def _exchange(self, address: str, request: Encoded, timeout: float,
                  decoder: FrameDecoder) -> tuple[Decoded, float]:
        """Serve the request at `address`; both ends count gRPC's framing for it.  A message of a
        batch (`call_many`) comes with its share of the batch's framing set, and its reply is
        never pulled (a gRPC batch reads its replies without receive slots); any other request
        is framed here as `GrpcEndpoint` would send it."""
        pulled = False
        if request.framing is None:
            pulled = pulls_reply(decoder, self.chunk_bytes)
            request.framing = request_framing(request, self.chunk_bytes, pulled)
        target, handler, _ = self.network.lookup(address)
        bundles: ReplyBundles | None = request.reply_bundles   # a batch's reply: bundled as gRPC's (`ReplyBundles`)
        framed: list[int] = []

        def reply_framing(lengths: list[int]) -> int:
            assert bundles is not None
            framed.append(bundles.place(lengths)[1])
            return framed[-1]

        with target.serving():
            started = time.perf_counter()
            reply_frames = target.serve_frames(list(request.frames), handler, framing=request.framing,
                                               pulled=pulled,
                                               reply_framing=reply_framing if bundles is not None else None)
            sent = time.perf_counter() - started
            for frame in reply_frames:
                decoder.feed(frame)
            decoded = decoder.finish()
        if bundles is not None:   # an unrouted error reply was not placed by the callee
            decoded.framing = framed[0] if framed else bundles.place([len(f) for f in reply_frames])[1]
        return decoded, sent

    def call_many(self, address: str, requests: Sequence[Batched], *, round: int, step: int = 0,
                  timeout: float, on_each: Callable[[int, Payload | Exception], None] | None = None
                  ) -> list[Payload | Exception]:
        """As `GrpcEndpoint.call_many`: requests that gRPC would send in one `Call` record their
        shares of its framing (`batch_framing`); the callee serves them one after another, as
        gRPC's `Call` handler does, and `on_each` hears each result as it is known.  Others go
        one call each."""
        if not shares_one_call(requests, self.chunk_bytes):
            return super().call_many(address, requests, round=round, step=step, timeout=timeout, on_each=on_each)
        msgs, calls = self.batch_messages(requests, round=round, step=step)   # framed as gRPC's calls of the batch
        target, _, _ = self.network.lookup(address)
        for call in calls:   # replies bundled as the callee's gRPC `Call` would send them (`ReplyBundles`)
            replies = ReplyBundles(target.chunk_bytes, target.replies_per_bundle) if len(call) > 1 else None
            for i in call:
                msgs[i].reply_bundles = replies
        # a callee served elsewhere takes the whole batch at once (deploy/launch/workers.py
        # `WorkerEndpoint`); one served here shows it to its `before_batch` (`pipelined`); the
        # caller's records of the batch go to its ledger file in one write as it ends, as a gRPC
        # caller writes a reply bundle's (`Ledger.deferred`)
        ahead = target.pipelined(msgs)
        with target.serving(), ahead, self.ledger.deferred():
            return one_by_one(len(requests), lambda i: self._call_message(
                address, msgs[i], message_link(self.node_id, requests[i].dst, requests[i].method), timeout,
                requests[i].expect), on_each)

    def _register_rpc(self, address: str, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:
        """One Register call with a fresh key, as `GrpcEndpoint._register_rpc` sends it (the
        ledger counts the key's bytes); the parent probes the claimed address before its handler."""
        request.proof_key = REGISTRATION_KEYS.issue(request.node_id)
        target, _, register_handler = self.network.lookup(address)
        if register_handler is None:
            raise CallFailed("UNIMPLEMENTED", "peer accepts no registrations", address)
        sent = pb.RegisterRequest.FromString(request.SerializeToString())
        return target.handle_registration(target._proved(register_handler), sent)

    def _proved(self, register_handler: RegisterHandler) -> RegisterHandler:
        """The role's handler, for a registrant that proved its address (gRPC's `proved`)."""
        def proved(request: pb.RegisterRequest) -> pb.RegisterReply:
            refusal = self.probe(request)
            if refusal is not None:
                return pb.RegisterReply(accepted=False, message=refusal, node_id=self.node_id)
            return register_handler(request)
        return proved

    def probe(self, request: pb.RegisterRequest) -> str | None:
        """Whether the endpoint attached at `request.address` sent `request`, asked as
        `GrpcEndpoint.probe` asks it (the same messages and records): None when it answers with
        the proof under the request's key, else the refusal (ADDRESS_UNPROVEN)."""
        address, target = request.address, request.node_id
        unproven = f"ADDRESS_UNPROVEN: {target} did not prove that it serves at {address}"
        if not request.proof_key:
            return f"{unproven}: the registration carries no proof key"
        try:
            peer, _, _ = self.network.lookup(address)
        except CallFailed as exc:
            return f"{unproven}: the probe of {address} failed ({exc.code}: {exc.detail})"
        probe, msg_id = self.probe_request(request)
        started = time.perf_counter()
        reply = peer.answer_probe(pb.ProbeRequest.FromString(probe.SerializeToString()))
        return self.probe_outcome(request, probe, reply, msg_id, time.perf_counter() - started, unproven,
                                  "the endpoint there")

    def answer_probe(self, request: pb.ProbeRequest) -> pb.ProbeReply:
        """The served side of a probe (grpc.py `probe_rpc_handler` and its records): the proof of
        a registration this endpoint's node sent, or empty."""
        proof = REGISTRATION_KEYS.answer(request.target, request.key_id, request.nonce) \
            if request.target == self.node_id else b""
        reply = pb.ProbeReply(node_id=self.node_id, proof=proof)
        msg_id = f"probe-{request.target}-{request.nonce.hex()}"
        caller = request.parent or "parent"
        self.record_control("probe", caller, request.target, request.ByteSize(), "receiver", 0.0, msg_id,
                            request.run_id)
        self.record_control("probe.reply", request.target, caller, reply.ByteSize(), "sender", 0.0,
                            msg_id + ".reply", request.run_id)
        return pb.ProbeReply.FromString(reply.SerializeToString())

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
                         "(deploy/launch/inmemory.py); a process run uses grpc or torch")
    return InMemoryEndpoint(network, node_id, ledger, **options)
