"""gRPC transport: `Exchange` is a bidirectional stream of raw `Frame` bytes.

A request no larger than one chunk goes as `Call` instead: its frames in one unary request
(`FrameBundle`), the reply streamed as Exchange's.  grpcio spends a thread and several
hand-offs per streaming request; for the many small messages of a round (broadcasts of small
models, replies, control) the unary request halves the per-call cost (docs/performance.md).

The frames are already valid protobuf `Frame` messages (common/wire/codec.py builds them), so the
stream uses identity (de)serializers: gRPC moves our bytes without another protobuf pass.
Message-size limits are set on both the server and every channel; every call has a deadline.

Security (common/security/auth.py): with `credentials` holding TLS files the server port and every
channel use TLS (mutual TLS when `credentials.mtls`); every call carries the node credential in
metadata and every served call passes `AuthInterceptor` first.

Transient failures: a call that fails UNAVAILABLE before a connection to the peer was
established (gRPC's "failed to connect to all addresses": the request never reached a transport,
so no byte of it was delivered) is tried again after a backoff (0.25 s, doubling, at most 2 s)
for at most RETRY_WINDOW seconds and within its deadline; such attempts put nothing on the wire
and leave no ledger record, and `retries` counts them.  An address whose call gave up that way
gets no retries (it fails at once, as a dead peer should) until a call to it succeeds or it
registers again.  Any other failure (the request may have been delivered) is final.

Batches (`call_many`, used by the fabric with `transport.batch = true`): the requests to several
logical clients of one process travel in one `Call`, their messages back to back in the bundle
(each its own header and data frames, envelope and msg_id), and the replies come back in the same
order on the call's stream.  Each message's envelope carries its request's own step (an
asynchronous dispatch's: `Batched.step`).  Every message keeps its ledger records on both ends,
with its exact tensor and payload bytes; framing is shared so that the messages' framed bytes add up to what the
call put on the wire: each message counts its own frames' bundle tags and lengths, the first
message also the bundle's 5-byte gRPC prefix (common/transport/base.py `batch_framing`).  The
replies come back bundled too: back to back in FrameBundle messages of up to
`transport.reply_bundle` replies (16) and one chunk (`ReplyBundles`, `reply_bundles` below), so a
process answering 256 small train calls sends 16 gRPC messages instead of one per frame; each
reply counts its frames' tags and length varints and the 5-byte prefix of each bundle it opens, on
both ends alike.  The price: a reply waits for the others of its bundle, so at a round's deadline
a process still training loses up to reply_bundle - 1 replies it had computed (1: each reply goes
the moment it is computed, in one message).  The callee decodes every request of the call before it
handles the first (`Endpoint.serve_batch`).  A
call of one message is answered as any Call.

Pulled replies: a streaming fold receives one reply at a time (common/processors/streaming.py
`OrderedFold.admit`).  A reply waiting for its slot must then wait at its sender: HTTP/2 gives
every new stream the receiver's whole window (`transport.window_bytes`) before it reads anything,
so a reply that simply streamed would sit in the receiver's gRPC buffers, a window per waiting
client.  So a call whose reply takes a slot and may span several frames is pulled: it goes as
`Exchange` with PULL_METADATA; the callee reads the request only up to its last data byte (the
stream stays open), sends its reply's header frame and waits; the caller sends one empty
message on the request stream, the go (GO), once the reply has its slot, and the callee sends
the rest.  A call that gets no slot in time is cancelled without its go, so none of the reply's
data ever moved.  The go counts in the request's framed bytes on both ends (5 bytes: one more
gRPC message).  The header frame is small (the envelope), so the receiver's memory for waiting
replies is a header each, whatever the window.  A callee that sends its data without waiting for
the go gains nothing: the caller reads none of it before the slot, and gRPC holds at most the
stream's window of it (HTTP/2 flow control).  That window is fixed (`transport.window_bytes`,
16 MiB; `grpc_options`): with gRPC's adaptive window (BDP probing and 64 MiB of read-ahead) such a
callee put 32-190 MiB per call into the caller, and one stream on loopback moves a model as fast
either way (docs/performance.md, "A callee that ignores the go").

Taken requests: likewise a request is not left to flow control.  A client process trains one
client at a time, and the server sends the round's model to all of its clients at once: had each
request streamed whole, a process hosting k clients would hold k models.  So every `Exchange`
request (TAKE_METADATA) sends its header frame and waits; the callee reads the header (checked by
`Endpoint.request_gate`), waits until it has room for the data (`Endpoint.request_hold`: for a
client process, two large train requests at once, client/host.py) and sends its initial
metadata, the caller's signal to send the data frames, which it cuts only then.  A caller that
gives up while its request waits is refused CANCELLED.  Nothing is added to the stream, so the
ledger is unchanged; the signal costs a round trip per streamed request (one of more than a
chunk).

Fair share (common/transport/admission.py `CallSlots`, `SlotInterceptor` below): every served call takes
a slot of its lane before its request is read: data calls (Exchange, Call), registrations
(Register) and quick control calls (Heartbeat, Probe) each have their own share of the worker
threads (`lane_sizes`), a global cap and a per-caller cap (its authenticated node id), so a flood
in one lane never takes another's threads: heartbeats are answered whatever the slow streams and
slow registrations held open.  A control call's request must arrive within
`CONTROL_READ_SECONDS` or the call is cancelled (`ReadDeadline`).  Only this process's parent is
exempt from the data lane's limits, and only where its call proves it (`PARENT_META`, the proof
of this process's registration key; `call_slots.privileged` names the parent): a caller that
merely claims the parent's node id is any caller.  A call over a limit is refused
RESOURCE_EXHAUSTED at once.  Requests are bounded by their method and checked against the caller
on their header frame before any data is read (`Endpoint.request_gate`).

Addresses proved (common/transport/admission.py `RegistrationKeys`): every Register carries a fresh
key (`_register_rpc`); before a registration is handled the parent probes the address it claims
(`probe`: the Probe RPC with a nonce, under TLS on a channel that verifies the registrant's node
id in the certificate there) and accepts it only when the process serving there answers with the
HMAC of the nonce and node id under that key: a registration names only an address its own
process serves, a dead node's address is free for its own restart and for whoever proves to
serve there, and a second registration of a live node id from its address must prove it too.
Once a registration is accepted, the parent's calls to that address carry `PARENT_META`.

Wire compression (`transport.wire_compression`, docs/compression.md): gRPC's own
compression (gzip or deflate) of every message of the data calls, registrations and heartbeats,
both directions: a call's request is compressed by the caller (`compression=` on the call) and
its reply by the callee (`ServicerContext.set_compression` as the handler starts).  It is set per
call, not as the channel's or the server's default, because a child process learns the run's
config only from its registration reply, after its server and its channel to the parent exist
(client/runtime.py, edge/runtime.py set `wire_compression` then).  gRPC decompresses whatever
arrives whatever this end's setting, so both ends need not agree.  The ledger counts the framed
bytes fedhop hands to gRPC, before gRPC compresses them; what reaches the socket is measured by
benchmarks/wire_compression.py.

Liveness (common/transport/liveness.py):
`Heartbeat` calls go to `self.liveness`; `mark_dead(address)` cancels the calls in flight to a
dead child and makes later ones fail at once (NODE_DEAD) until it registers again.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator, Sequence, overload

import grpc
import grpc.experimental

from fedhop.common.security.auth import CLUSTER_NAME, META_NODE, AuthInterceptor, NodeCredentials, RefusedHook
from fedhop.common.transport.admission import (
    CONTROL_READ_SECONDS,
    PARENT_META,
    PROBE_SECONDS,
    READ_DEADLINES,
    REGISTRATION_KEYS,
    CallSlots,
    lane_of,
    parent_proof,
)
from fedhop.common.transport.base import (
    NOTHING_SENT,
    Batched,
    CallFailed,
    Endpoint,
    Handler,
    RemoteError,
    ReplyBundles,
    batch_framing,
    pulls_reply,
    request_framing,
    sent_bundled,
    shares_one_call,
)
from fedhop.common.util.heap import SendBurst, transient_bytes
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import (
    FRAME_OVERHEAD,
    Decoded,
    Encoded,
    FrameDecoder,
    PayloadError,
    bundle_bytes,
    bundle_framing,
    frame_framing,
    split_bundle,
)
from fedhop.common.wire.ledger import Ledger
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import message_link

EXCHANGE = "/fedhop.Fedhop/Exchange"
CALL = "/fedhop.Fedhop/Call"            # a request of at most one chunk, bundled (proto FrameBundle)
REGISTER = "/fedhop.Fedhop/Register"
HEARTBEAT = "/fedhop.Fedhop/Heartbeat"
PROBE = "/fedhop.Fedhop/Probe"            # a parent's check that a registrant serves at its address
PULL_METADATA = ("fedhop-pull", "1")     # the caller pulls the reply's data frames (module docstring)
TAKE_METADATA = ("fedhop-take", "1")     # the callee takes the request's data frames when ready (module docstring)
GO = b""                                 # the go message of a pulled reply: an empty gRPC message
RETRY_BACKOFF = (0.25, 2.0)              # first delay and cap of the not-delivered retry, seconds
RETRY_WINDOW = 4.0                       # seconds a call may spend retrying (and within its deadline)
# A `Call` (unary request, streamed reply) read in the calling thread from its own completion queue:
# without it grpcio starts a channel spin thread for a call on an idle channel and hands every
# reply frame over from it (a third of a small call's caller CPU; docs/performance.md).
CALL_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


class NotDelivered(CallFailed):
    """The call failed before a connection to the peer existed: no byte of the request was sent."""

    delivered = False


def not_delivered(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE from gRPC's subchannel before any transport carried the call (connection
    refused, reset or timed out during the TCP or HTTP/2 handshake)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect to all addresses" in (exc.details() or "")


#: `transport.wire_compression` -> gRPC's compression of the messages of a call (None: none, and
#: no compression metadata on the call: the default path unchanged)
WIRE_COMPRESSION: dict[str, grpc.Compression | None] = {
    "none": None, "gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}


#: the HTTP/2 window of every stream (`transport.window_bytes`): the most a peer can send on a
#: stream this process has not read (module docstring, Pulled replies)
WINDOW_BYTES = 16 << 20


def grpc_options(max_message_bytes: int, server: bool = False,
                 max_receive_bytes: int | None = None, window_bytes: int = WINDOW_BYTES) -> list[tuple[str, int]]:
    """Channel and server options.  Clients ping every 30 s so a dead peer is noticed during
    a long call; servers accept pings that often (their default minimum is 5 minutes, after
    which they answer GOAWAY "too_many_pings" and cut long calls).  `max_receive_bytes`: a
    server's bound on one incoming gRPC message, checked against its length prefix before the
    body is read (before authentication has looked at anything but the metadata).
    `window_bytes`: every stream's flow-control window, fixed (BDP probing off), so a peer can
    put at most that much into this process on a stream it does not read."""
    extra = [("grpc.http2.min_ping_interval_without_data_ms", 10_000),
             ("grpc.http2.min_time_between_pings_ms", 10_000)] if server else []
    return extra + [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.lookahead_bytes", window_bytes),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.max_frame_size", 16 << 20),
    ]


RegisterHandler = "Callable[[pb.RegisterRequest], pb.RegisterReply]"


def heartbeat_msg_id(request: pb.HeartbeatRequest) -> str:
    """Both ends name a heartbeat alike, so the ledger pairs its sender and receiver records."""
    return f"heartbeat-{request.node_id}-{request.sent_at:.6f}-{request.seq}"


class GrpcEndpoint(Endpoint):
    def __init__(self, node_id: str, ledger: Ledger, run_id: str = "", token: str = "",
                 chunk_bytes: int = 4 << 20, max_payload_bytes: int = 1 << 31,
                 max_message_bytes: int = 64 << 20, workers: int = 16,
                 credentials: NodeCredentials | None = None, on_refused: RefusedHook | None = None,
                 window_bytes: int = WINDOW_BYTES, wire_compression: str = "none") -> None:
        super().__init__(node_id, ledger, run_id, token, chunk_bytes, max_payload_bytes)
        if wire_compression not in WIRE_COMPRESSION:
            raise ValueError(f"transport.wire_compression = {wire_compression!r} is not one of "
                             f"{', '.join(WIRE_COMPRESSION)}")
        self.wire_compression = wire_compression   # module docstring, Wire compression; changed when the config comes
        self.credentials = credentials
        self.on_refused = on_refused
        self.interceptor: AuthInterceptor | None = None
        self.peer_names: dict[str, str] = {}      # address -> node id to verify in its TLS certificate
        self.child_proofs: dict[str, str] = {}    # address -> PARENT_META of the child registered there
        self._inflight: dict[str, set] = {}       # address -> gRPC calls in flight (cancelled when it dies)
        self._dead: dict[str, str] = {}           # address -> why it was marked dead
        if max_message_bytes < chunk_bytes + 1024:
            raise ValueError(f"transport.max_message_bytes ({max_message_bytes}) must exceed "
                             f"transport.chunk_bytes ({chunk_bytes}) plus the frame header")
        self.max_message_bytes = max_message_bytes
        self.window_bytes = window_bytes
        self.workers = workers
        self.call_slots = CallSlots(workers)      # data calls at once, in all and per caller (module docstring)
        self.on_busy: RefusedHook | None = None   # (caller, method, reason, peer) of a call refused by call_slots
        self._server: grpc.Server | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.register_handler = None
        self.retries = 0                          # attempts that failed before connecting, then retried
        self._unreachable: set[str] = set()       # addresses whose last call gave up before connecting
        self.sends = SendBurst()                  # streamed requests in flight (common/util/heap.py)

    # -- client side ----------------------------------------------------------------
    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                # reconnect soon after a peer comes back (gRPC's default backoff grows to 120 s)
                options = grpc_options(self.max_message_bytes, window_bytes=self.window_bytes)
                options += [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                            ("grpc.max_reconnect_backoff_ms", 2000)]
                # a connection of this channel's own: gRPC otherwise shares one per address across the
                # process's channels, so a new endpoint would inherit an earlier one's failed
                # connection to the address (its last error, until that backoff ends)
                options += [("grpc.use_local_subchannel_pool", 1)]
                options += CALL_OPTIONS
                tls = self.credentials.channel_credentials() if self.credentials is not None else None
                if tls is None:
                    ch = grpc.insecure_channel(address, options=options)
                else:  # verify the peer's certificate names the node we expect (or any cluster node)
                    name = self.peer_names.get(address, CLUSTER_NAME)
                    ch = grpc.secure_channel(address, tls, options=options + [("grpc.ssl_target_name_override", name)])
                self._channels[address] = ch
            return ch

    def _compression(self) -> grpc.Compression | None:
        """The compression of the requests this process sends now (module docstring, Wire compression)."""
        return WIRE_COMPRESSION[self.wire_compression]

    def _compress_replies(self, context: grpc.ServicerContext) -> None:
        """Compress this served call's reply messages as `wire_compression` says; called before the
        handler sends its initial metadata (gRPC announces the encoding there)."""
        algorithm = WIRE_COMPRESSION[self.wire_compression]
        if algorithm is not None:
            context.set_compression(algorithm)

    def _metadata(self, audience: str = "", address: str = ""):
        """The call's credential; `audience`: the node or logical client called (per-node tokens
        are signed for it, common/security/auth.py); "" for Register and Heartbeat.  A call to the
        address of a child registered here also carries the proof of its registration key
        (PARENT_META): what lets the child serve it as its parent's."""
        meta = tuple(self.credentials.metadata(audience)) if self.credentials is not None else ()
        with self._lock:
            proof = self.child_proofs.get(address) if address else None
        if proof is not None:
            meta += ((PARENT_META, proof),)
        return meta or None

    # -- liveness -------------------------------------------------------------------
    def mark_dead(self, address: str, reason: str) -> int:
        """Cancel the calls in flight to `address`; later calls fail at once until `mark_alive`."""
        with self._lock:
            self._dead[address] = reason
            calls = list(self._inflight.get(address, ()))
        for call in calls:
            call.cancel()
        return len(calls)

    def mark_alive(self, address: str) -> None:
        with self._lock:
            self._dead.pop(address, None)
            self._unreachable.discard(address)

    def heartbeat(self, address: str, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        stub = self.channel(address).unary_unary(
            HEARTBEAT, request_serializer=pb.HeartbeatRequest.SerializeToString,
            response_deserializer=pb.HeartbeatReply.FromString)
        started = time.perf_counter()
        try:
            reply = stub(request, timeout=timeout, wait_for_ready=False, metadata=self._metadata(),
                         compression=self._compression())
        except grpc.RpcError as exc:
            raise CallFailed(exc.code().name, exc.details() or "", address) from None
        seconds = time.perf_counter() - started
        msg_id = heartbeat_msg_id(request)     # control messages, like registration: every byte is counted
        parent = reply.node_id or "parent"
        self.record_control("heartbeat", request.node_id, parent, request.ByteSize(), "sender", seconds, msg_id,
                            request.run_id)
        self.record_control("heartbeat.reply", parent, request.node_id, reply.ByteSize(), "receiver", seconds,
                            msg_id + ".reply", request.run_id)
        return reply

    @overload
    def _exchange(self, address: str, request: Encoded, timeout: float,
                  decoder: FrameDecoder) -> tuple[Decoded, float]: ...

    @overload
    def _exchange(self, address: str, request: Encoded, timeout: float,
                  decoder: BatchDecoder) -> tuple[list[Decoded | PayloadError], float]: ...

    def _exchange(self, address: str, request: Encoded, timeout: float,
                  decoder: FrameDecoder | BatchDecoder) -> tuple[Any, float]:
        """One call, tried again with backoff while it fails before connecting (module docstring);
        an attempt that never connected fed the decoder nothing, so the next one reuses it."""
        started = time.perf_counter()
        deadline = started + timeout
        give_up = started + min(timeout, RETRY_WINDOW)
        delay, cap = RETRY_BACKOFF
        while True:
            try:
                result = self._attempt(address, request, deadline - time.perf_counter(), started, decoder)
            except NotDelivered:
                with self._lock:
                    known_unreachable = address in self._unreachable
                    if known_unreachable or give_up - time.perf_counter() <= delay:
                        self._unreachable.add(address)
                        raise
                    self.retries += 1
                time.sleep(delay)
                delay = min(2 * delay, cap)
                continue
            with self._lock:
                self._unreachable.discard(address)
            return result

    def _attempt(self, address: str, request: Encoded, timeout: float, started: float,
                 decoder: FrameDecoder | BatchDecoder) -> tuple[Any, float]:
        sent = [0.0]
        gate: Any   # an OrderedFold's receive slots, or None
        gate, admitted = getattr(decoder, "gate", None), False   # streaming aggregation (common/processors/streaming.py)
        # a gated reply that may span frames is pulled (module docstring, Pulled replies)
        pull = isinstance(decoder, FrameDecoder) and pulls_reply(decoder, self.chunk_bytes)
        go = threading.Event()   # pulled: set once the reply has a receive slot, or the call is over
        # a batch is always one bundle (its calls are cut to fit, `batch_calls`): the callee splits it into messages
        bundled = isinstance(decoder, BatchDecoder) or sent_bundled(request, self.chunk_bytes, pull)
        taken = threading.Event()   # a streamed request: set once the callee took it, or the call is over
        framing = request_framing(request, self.chunk_bytes, pull)   # None: a plain stream, 5 bytes a frame
        if framing is not None:
            request.framing = framing
        if bundled:
            stub = self.channel(address).unary_stream(CALL, request_serializer=None, response_deserializer=None)
        else:
            stub = self.channel(address).stream_stream(EXCHANGE, request_serializer=None,
                                                       response_deserializer=None)

        def frames():   # a handed-over message's frames are cut (and hashed) here, as gRPC pulls them (codec.Frames)
            self.sends.begin()
            moved = 0
            try:
                source = iter(request.frames)
                header = next(source)
                moved += len(header)
                yield header
                taken.wait()   # the data frames (cut from here on, as they are pulled) once the callee took the request
                for frame in source:
                    moved += len(frame)
                    yield frame
            finally:
                # the last send of a burst that left enough in the heap trims it (common/util/heap.py)
                self.sends.end(transient_bytes(moved, self.chunk_bytes))
            sent[0] = time.perf_counter() - started
            if pull:
                go.wait()
                if admitted:
                    yield GO

        with self._lock:
            dead = self._dead.get(address)
        if dead is not None:
            raise CallFailed("NODE_DEAD", dead, request.envelope.dst)
        metadata = (*(self._metadata(request.envelope.dst, address) or ()), *((PULL_METADATA,) if pull else ()),
                    *(() if bundled else (TAKE_METADATA,)))
        call = stub(bundle_bytes(request.frames) if bundled else frames(), timeout=timeout, wait_for_ready=False,
                    metadata=metadata or None, compression=self._compression())
        with self._lock:
            self._inflight.setdefault(address, set()).add(call)
        if bundled:
            sent[0] = time.perf_counter() - started   # the unary request is handed to gRPC whole
            if isinstance(decoder, BatchDecoder):
                decoder.sent_seconds = sent[0]
        try:
            if not bundled:
                call.initial_metadata()   # the callee took the request (its initial metadata), or the call ended
                taken.set()
            for frame in call:
                if gate is not None and not admitted:   # the reply began: wait for a receive slot first
                    if not (admitted := gate.admit(timeout - (time.perf_counter() - started))):
                        call.cancel()
                        raise CallFailed("DEADLINE_EXCEEDED", "no receive slot for the reply in time",
                                         request.envelope.dst)
                    go.set()   # pulled: the callee sends the rest of its reply now
                if isinstance(decoder, BatchDecoder) and decoder.bundled:   # a batch's replies come in bundles
                    with self.ledger.deferred():   # the bundle's records in one write
                        decoder.feed_bundle(frame)
                else:
                    decoder.feed(frame)
            return decoder.finish(), sent[0]
        except grpc.RpcError as exc:
            with self._lock:
                dead = self._dead.get(address)
            if dead is not None and exc.code() == grpc.StatusCode.CANCELLED:
                raise CallFailed("NODE_DEAD", dead, request.envelope.dst) from None
            if decoder.envelope is not None:   # the reply began and was cut off: say how much arrived
                raise CallFailed("TRUNCATED", f"reply cut off after {decoder.filled} of "
                                              f"{decoder.envelope.data_bytes} data bytes ({exc.code().name}: "
                                              f"{exc.details() or ''})", request.envelope.dst) from None
            failure = NotDelivered if not_delivered(exc) else CallFailed
            raise failure(exc.code().name, exc.details() or "", request.envelope.dst) from None
        except PayloadError:   # a malformed or corrupted reply: typed, the caller records the rejection
            call.cancel()
            raise
        finally:
            go.set()   # a request stream still waiting for its go message ends without it
            taken.set()
            with self._lock:
                self._inflight.get(address, set()).discard(call)

    def request_bound(self) -> int:
        """The largest incoming request message: one frame of an Exchange stream, or a Call's bundle
        of a request no larger than chunk_bytes (common/wire/codec.py), plus 1 MiB for headers."""
        return min(self.max_message_bytes, self.chunk_bytes + (1 << 20))

    def _register_rpc(self, address: str, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:
        """One Register call, with a fresh key for the parent's probe of our address (module
        docstring, Addresses proved)."""
        request.proof_key = REGISTRATION_KEYS.issue(request.node_id)
        stub = self.channel(address).unary_unary(
            REGISTER, request_serializer=pb.RegisterRequest.SerializeToString,
            response_deserializer=pb.RegisterReply.FromString)
        try:
            return stub(request, timeout=timeout, wait_for_ready=False, metadata=self._metadata(),
                        compression=self._compression())
        except grpc.RpcError as exc:
            raise CallFailed(exc.code().name, exc.details() or "", address) from None

    def probe(self, request: pb.RegisterRequest, timeout: float = PROBE_SECONDS) -> str | None:
        """Whether the process serving at `request.address` sent `request` (module docstring,
        Addresses proved): None when it answers the probe with the proof under the request's key,
        else the refusal (ADDRESS_UNPROVEN).  A channel of its own, closed after: under TLS it
        verifies the registrant's node id in the certificate served there."""
        address, target = request.address, request.node_id
        unproven = f"ADDRESS_UNPROVEN: {target} did not prove that it serves at {address}"
        if not request.proof_key:
            return f"{unproven}: the registration carries no proof key"
        options = grpc_options(64 << 10) + [("grpc.initial_reconnect_backoff_ms", 200)]
        tls = self.credentials.channel_credentials() if self.credentials is not None else None
        try:
            channel = grpc.insecure_channel(address, options=options) if tls is None else \
                grpc.secure_channel(address, tls, options=options + [("grpc.ssl_target_name_override", target)])
        except Exception as exc:   # not an address gRPC can dial
            return f"{unproven}: {exc}"
        req, msg_id = self.probe_request(request)
        started = time.perf_counter()
        try:
            stub = channel.unary_unary(PROBE, request_serializer=pb.ProbeRequest.SerializeToString,
                                       response_deserializer=pb.ProbeReply.FromString)
            reply = stub(req, timeout=timeout, wait_for_ready=False, metadata=self._metadata(target))
        except grpc.RpcError as exc:
            return f"{unproven}: the probe of {address} failed ({exc.code().name}: {exc.details() or ''})"
        finally:
            channel.close()
        return self.probe_outcome(request, req, reply, msg_id, time.perf_counter() - started, unproven,
                                  "the process there")

    def call_many(self, address: str, requests: Sequence[Batched], *, round: int, step: int = 0,
                  timeout: float, on_each: Callable[[int, Payload | Exception], None] | None = None) -> list:
        """Several logical clients' requests to one process in one `Call` (module docstring,
        Batches), or in as few as keep each call's bundle within one chunk (`batch_calls`); a batch
        whose payloads exceed one chunk goes one call each.  Each reply is recorded and passed to
        `on_each` as soon as it is in; a call that fails (the deadline, the process lost) fails
        only the requests still unanswered.  The calls share `timeout`."""
        if not shares_one_call(requests, self.chunk_bytes):
            return super().call_many(address, requests, round=round, step=step, timeout=timeout, on_each=on_each)
        msgs, calls = self.batch_messages(requests, round=round, step=step)
        out: list = [None] * len(requests)
        deadline = time.perf_counter() + timeout
        for call in calls:
            self._batch_call(address, call, msgs, requests, round, deadline - time.perf_counter(), out, on_each)
        return out

    def _batch_call(self, address: str, call: range, msgs: list[Encoded], requests: Sequence[Batched], round: int,
                    timeout: float, out: list, on_each: Callable[[int, Payload | Exception], None] | None) -> None:
        """The messages `call` of a batch in one `Call`; their results go to `out` (and `on_each`) by index."""
        links = {i: message_link(self.node_id, requests[i].dst, requests[i].method) for i in call}
        bundle = Encoded(frames=[f for i in call for f in msgs[i].frames], envelope=msgs[call.start].envelope,
                         tensor_bytes=sum(msgs[i].tensor_bytes for i in call))
        started = time.perf_counter()

        def settle(j: int, reply: Decoded | PayloadError) -> None:
            i = call[j]
            msg, link = msgs[i], links[i]
            seconds = time.perf_counter() - started - decoder.sent_seconds
            result: Payload | Exception
            if isinstance(reply, PayloadError):
                self._record(msg.envelope, msg, "sender", link, seconds, error=f"reply rejected: {reply}")
                result = PayloadError(reply.code, f"reply of {msg.envelope.dst} to {msg.envelope.method} "
                                                  f"(round {round}): {reply.detail}")
            else:
                self._record(msg.envelope, msg, "sender", link, decoder.sent_seconds)
                try:
                    result = self._settle(msg, reply, link, seconds)
                except (PayloadError, RemoteError) as exc:   # its traceback holds this frame, and so
                    result = exc.with_traceback(None)         # the batch's decoder: no cycle through it
            out[i] = result
            if on_each is not None:
                on_each(i, result)

        decoder = BatchDecoder([self._decoder(requests[i].expect) for i in call], on_done=settle)
        try:
            self._exchange(address, bundle, max(timeout, 0.0), decoder)
        except CallFailed as exc:   # the call ended: every request not yet answered is lost, as one call would be
            for i in call[len(decoder.done):]:
                msg = msgs[i]
                self._record(msg.envelope, msg if exc.delivered else NOTHING_SENT, "sender", links[i],
                             time.perf_counter() - started, status="lost", error=str(exc))
                out[i] = exc
                if on_each is not None:
                    on_each(i, exc)
        except PayloadError as exc:   # a reply that broke the framing ends the call's stream there
            decoder.cut(exc)
        finally:   # `settle` and `decoder` refer to each other: left as a cycle, every reply of the batch
            decoder.on_done = None   # (its buffer and tensors) would wait for the garbage collector

    # -- server side ----------------------------------------------------------------
    def _note_peer(self, address: str, node_id: str, key: bytes = b"") -> None:
        """A child registered from `address` with registration key `key`.  With TLS, channels
        verify that the child's certificate names it.  A channel opened before this first
        registration (the round may start the moment the last child is accepted) verifies the
        cluster name and stays; only a different node now at a known address needs a new
        channel.  Calls to the address carry the proof of the key from now on (PARENT_META)."""
        with self._lock:
            known = self.peer_names.get(address)
            self.peer_names[address] = node_id
            if key:
                self.child_proofs[address] = parent_proof(key, node_id)
            stale = self._channels.pop(address, None) if known is not None and known != node_id else None
        if stale is not None:
            stale.close()

    def serve(self, handler: Handler, bind: str, register_handler=None) -> str:
        """Serve Exchange (and Register when `register_handler` is given) on `bind` (host:port)."""
        endpoint = self
        note_peer = self._note_peer

        def exchange(request_iterator, context):
            endpoint._compress_replies(context)
            # decode each frame as it arrives: the copy into the message buffer overlaps the
            # transfer of the next frame, and a received frame is freed once copied
            def take(env: pb.Envelope) -> Callable[[], None] | None:
                """The request's header is in: wait for room for its data (`Endpoint.request_hold`),
                then tell the caller to send it (module docstring, Taken requests)."""
                release = endpoint.request_hold(env, context.is_active) if endpoint.request_hold else None
                try:
                    context.send_initial_metadata(())
                except grpc.RpcError:   # the call ended meanwhile
                    if release is not None:
                        release()
                    raise PayloadError("CANCELLED", "the caller gave up before its request was taken") from None
                return release

            on_header = take if _flagged(context, TAKE_METADATA) else None
            if not _flagged(context, PULL_METADATA):
                yield from endpoint.serve_frames(request_iterator, handler, on_header=on_header)
                return
            # pulled (module docstring): the request ends where its data does, its stream stays
            # open for the go message; the reply's header frame goes at once, the rest after go
            frames = iter(endpoint.serve_frames(request_iterator, handler, pulled=True, on_header=on_header))
            header = next(frames, None)
            if header is None:
                return
            yield header
            if next(request_iterator, None) != GO:   # the caller gave up (or sent something else)
                return
            yield from frames

        def call(bundle: bytes, context):
            endpoint._compress_replies(context)
            try:
                frames = list(pb.FrameBundle.FromString(bundle).frames)
            except Exception:   # protobuf's DecodeError: not a bundle; answered as an unrouted error
                frames = [b"\xff"]
            messages = split_bundle(frames)
            if len(messages) == 1:
                yield from endpoint.serve_frames(frames, handler, framing=bundle_framing(len(f) for f in frames))
                return
            yield from reply_bundles(endpoint, messages, handler)

        def proved(request: pb.RegisterRequest) -> pb.RegisterReply:
            """The role's handler, for a registrant that proved its address (module docstring,
            Addresses proved); after the liveness monitor's checks, which cost no call."""
            refusal = endpoint.probe(request)
            if refusal is not None:
                return pb.RegisterReply(accepted=False, message=refusal, node_id=endpoint.node_id)
            return register_handler(request)

        def register(request: pb.RegisterRequest, context) -> pb.RegisterReply:
            endpoint._compress_replies(context)
            if register_handler is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{endpoint.node_id} accepts no registrations")
            reply = endpoint.handle_registration(proved, request)
            if reply.accepted:
                note_peer(request.address, request.node_id, request.proof_key)
            return reply

        def record_probe(request: pb.ProbeRequest, reply: pb.ProbeReply, context) -> None:
            msg_id = f"probe-{request.target}-{request.nonce.hex()}"
            caller = request.parent or caller_key(context) or "parent"
            endpoint.record_control("probe", caller, request.target, request.ByteSize(), "receiver", 0.0, msg_id,
                                    request.run_id)
            endpoint.record_control("probe.reply", request.target, caller, reply.ByteSize(), "sender", 0.0,
                                    msg_id + ".reply", request.run_id)

        def heartbeat(request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
            endpoint._compress_replies(context)
            if endpoint.liveness is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{endpoint.node_id} takes no heartbeats")
            reply = endpoint.liveness.beat(request)   # type: ignore[union-attr]  # not None: context.abort raises
            msg_id = heartbeat_msg_id(request)
            endpoint.record_control("heartbeat", request.node_id, endpoint.node_id, request.ByteSize(), "receiver",
                                    0.0, msg_id, request.run_id)
            endpoint.record_control("heartbeat.reply", endpoint.node_id, request.node_id, reply.ByteSize(),
                                    "sender", 0.0, msg_id + ".reply", request.run_id)
            return reply

        handlers = {
            "Exchange": grpc.stream_stream_rpc_method_handler(exchange),
            "Call": grpc.unary_stream_rpc_method_handler(call),
            "Register": grpc.unary_unary_rpc_method_handler(
                register, request_deserializer=pb.RegisterRequest.FromString,
                response_serializer=pb.RegisterReply.SerializeToString),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                heartbeat, request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatReply.SerializeToString),
            "Probe": probe_rpc_handler(self.node_id, record_probe),
        }
        interceptors = []
        if self.credentials is not None and self.credentials.checks_calls:
            self.interceptor = AuthInterceptor(self.credentials, self.on_refused)
            interceptors.append(self.interceptor)
        interceptors.insert(0, SlotInterceptor(self.call_slots, lambda *a: self.on_busy and self.on_busy(*a),
                                               node_id=self.node_id))   # outermost: before a request is waited for
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers),
                             options=grpc_options(self.max_message_bytes, server=True,
                                                  max_receive_bytes=self.request_bound(),
                                                  window_bytes=self.window_bytes),
                             interceptors=interceptors)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fedhop.Fedhop", handlers),))
        server_creds = self.credentials.server_credentials() if self.credentials is not None else None
        port = server.add_secure_port(bind, server_creds) if server_creds is not None else server.add_insecure_port(bind)
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


def probe_rpc_handler(node_id: str, record: Callable[[pb.ProbeRequest, pb.ProbeReply, Any], None] | None = None):
    """The Probe RPC of a process serving as `node_id` (module docstring, Addresses proved): a
    parent checks a registration of this process (`RegistrationKeys`); the answer is the HMAC of
    its nonce under the key of a registration this process sent as `node_id`, or empty.  Any
    authenticated caller may ask (the registrant does not know its parent's node id before the
    reply): the answer is of no use but to the holder of the key.  `record`: the ledger's hook."""
    def probe(request: pb.ProbeRequest, context) -> pb.ProbeReply:
        proof = REGISTRATION_KEYS.answer(request.target, request.key_id, request.nonce) \
            if request.target == node_id else b""
        reply = pb.ProbeReply(node_id=node_id, proof=proof)
        if record is not None:
            record(request, reply, context)
        return reply
    return grpc.unary_unary_rpc_method_handler(probe, request_deserializer=pb.ProbeRequest.FromString,
                                               response_serializer=pb.ProbeReply.SerializeToString)


def reply_bundles(endpoint: Endpoint, messages: list[list[bytes]], handler: Handler) -> Iterator[bytes]:
    """A batch's messages served in order (`Endpoint.serve_batch`: all decoded, then each
    handled and answered), their replies sent back to back in FrameBundle messages (module
    docstring, Batches; `ReplyBundles` says which reply opens a bundle and what framing each
    counts)."""
    bundles = ReplyBundles(endpoint.chunk_bytes, endpoint.replies_per_bundle)
    pending: list[bytes] = []
    placed: list[list[bool]] = []   # where the reply being made opens bundles (`ReplyBundles.place`)

    def framing_of(lengths: list[int]) -> int:
        opens, framing = bundles.place(lengths)
        placed.append(opens)
        return framing

    served = endpoint.serve_batch([(message, batch_framing(i, map(len, message)), framing_of)
                                   for i, message in enumerate(messages)], handler)
    for made in served:
        reply = list(made)
        opens = placed.pop() if placed else bundles.place([len(f) for f in reply])[0]   # an unrouted error reply
        for frame, start in zip(reply, opens):
            if start and pending:
                yield bundle_bytes(pending)
                pending = []
            pending.append(frame)
        if bundles.full:
            yield bundle_bytes(pending)
            pending = []
    if pending:
        yield bundle_bytes(pending)


def _flagged(context: grpc.ServicerContext, flag: tuple[str, str]) -> bool:
    """The call's metadata holds `flag` (PULL_METADATA, TAKE_METADATA)."""
    return any((key, value) == flag for key, value in context.invocation_metadata() or ())


def caller_key(context: grpc.ServicerContext) -> str:
    """Who a served call comes from, for per-peer accounting: the certificate's node id (mutual
    TLS), else the node named in the metadata (verified by AuthInterceptor when credentials check
    calls), else "" (no credentials)."""
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:   # no auth context (plaintext)
        names = []
    if names:
        name = names[0]
        return name.decode() if isinstance(name, bytes) else str(name)
    for key, value in context.invocation_metadata() or ():
        if key == META_NODE and isinstance(value, str) and value:
            return value
    return ""   # no credential: unidentified (CallSlots limits it by its lanes' caps only)


class SlotInterceptor(grpc.ServerInterceptor):
    """Every served call holds a call slot (module docstring, Fair share) from the moment a worker
    thread takes it, before its request is read.  gRPC waits for a unary request inside the
    worker thread, before any handler code runs, so every handler is served here as its
    stream-request twin (the same bytes on the wire: HTTP/2 does not tell unary from streaming
    requests) that takes its slot and then reads the one message.  Outermost of the
    interceptors: it sees the handler AuthInterceptor returns (a refused credential's handler
    ends at once), and keys the caller by `caller_key` (verified by then: the token is checked
    from metadata before a handler is returned; mutual TLS names the certificate)."""

    def __init__(self, slots: CallSlots, on_busy: RefusedHook | None = None, node_id: str = "") -> None:
        self.slots, self.on_busy, self.node_id = slots, on_busy, node_id

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        kind = lane_of(method)
        slots, deser, ser, on_busy = self.slots, handler.request_deserializer, handler.response_serializer, self.on_busy
        node_id = self.node_id

        def take(context) -> tuple:
            peer = caller_key(context)
            proof = next((v for k, v in context.invocation_metadata() or () if k == PARENT_META), "") \
                if kind == "data" else ""
            parent = isinstance(proof, str) and REGISTRATION_KEYS.parent_proven(node_id, proof)
            refusal, key = slots.take(peer, kind, parent=parent)
            if refusal is not None:
                if on_busy is not None:
                    try:
                        on_busy(peer, method, refusal, context.peer())
                    except Exception:   # a broken hook must not keep the thread
                        pass
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"call refused: {refusal}")
            return key

        def one(request_iterator, context):
            # a control call's request is a few hundred bytes: one that has not arrived within
            # CONTROL_READ_SECONDS is cancelled, so a slow sender cannot keep its lane's thread
            ticket = READ_DEADLINES.arm(CONTROL_READ_SECONDS, context.cancel) if kind != "data" else None
            try:
                request = next(iter(request_iterator), None)
            except grpc.RpcError:
                request = None
            finally:
                if ticket is not None:
                    READ_DEADLINES.disarm(ticket)
            if request is None and not context.is_active():   # cancelled: the read deadline, or the caller
                context.abort(grpc.StatusCode.CANCELLED, f"no request within {CONTROL_READ_SECONDS:g}s")
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
            return request

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary(request_iterator, context):
                key = take(context)
                try:
                    return inner_uu(one(request_iterator, context), context)
                finally:
                    slots.release_slot(key)
            return grpc.stream_unary_rpc_method_handler(unary, request_deserializer=deser, response_serializer=ser)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            def stream_unary(request_iterator, context):
                key = take(context)
                try:
                    return inner_su(request_iterator, context)
                finally:
                    slots.release_slot(key)
            return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=deser,
                                                        response_serializer=ser)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request_iterator, context):
                key = take(context)
                try:
                    yield from inner_us(one(request_iterator, context), context)
                finally:
                    slots.release_slot(key)
            return grpc.stream_stream_rpc_method_handler(unary_stream, request_deserializer=deser,
                                                         response_serializer=ser)
        inner_ss = handler.stream_stream

        def stream(request_iterator, context):
            key = take(context)
            try:
                yield from inner_ss(request_iterator, context)
            finally:
                slots.release_slot(key)
        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=deser, response_serializer=ser)


class BatchDecoder:
    """The replies of a batch (`GrpcEndpoint.call_many`), one decoder each, fed in order from
    the call's stream.  Each reply's outcome (a Decoded, or the PayloadError that refused it) is
    passed to `on_done(i, outcome)` the moment that reply is complete, so the caller can use it
    while later replies are still being computed.  A reply whose bytes fail their checksum leaves
    the framing intact (its header said how many bytes it has): it fails alone and the next reply
    is read.  A framing error (a malformed or oversized frame) ends the stream there (`cut`).
    `envelope` and `filled` describe the reply being received; `sent_seconds` is set by the
    transport once the request is handed over."""

    def __init__(self, decoders: list[FrameDecoder],
                 on_done: Callable[[int, Decoded | PayloadError], None] | None = None) -> None:
        self.decoders = decoders
        self.done: list[Decoded | PayloadError] = []
        self.on_done = on_done
        self.sent_seconds = 0.0
        self.framing = 0   # the framing bytes of the reply being received so far
        # the replies come in bundles: a call of two or more messages (the callee serves a call of
        # one as any bundled request, its reply streamed a frame per message)
        self.bundled = len(decoders) > 1

    @property
    def current(self) -> FrameDecoder:
        return self.decoders[min(len(self.done), len(self.decoders) - 1)]

    @property
    def envelope(self):
        return self.current.envelope

    @property
    def filled(self) -> int:
        return self.current.filled

    def feed_bundle(self, message: bytes) -> None:
        """One message of the call's reply stream: a FrameBundle of reply frames (`ReplyBundles`)."""
        try:
            frames = pb.FrameBundle.FromString(message).frames
        except Exception:   # protobuf's DecodeError
            raise PayloadError("MALFORMED_FRAME", "a reply message of the batch is not a frame bundle") from None
        if not frames:
            raise PayloadError("MALFORMED_FRAME", "an empty reply bundle")
        for k, frame in enumerate(frames):
            self.feed(frame, FRAME_OVERHEAD if k == 0 else 0)

    def feed(self, frame: bytes, prefix: int = 0) -> None:
        """One reply frame; `prefix`: the gRPC message prefix it opened (the first of a bundle)."""
        if len(self.done) == len(self.decoders):
            raise PayloadError("MALFORMED_FRAME", f"a frame after the batch's {len(self.decoders)} replies")
        decoder = self.decoders[len(self.done)]
        decoder.feed(frame)
        self.framing += prefix + frame_framing([len(frame)])
        if decoder.complete:
            outcome: Decoded | PayloadError
            try:
                outcome = decoder.finish()
                outcome.framing = self.framing   # its share of the bundles it came in
            except PayloadError as exc:   # complete yet refused (its checksum): this reply alone
                outcome = exc
            self.framing = 0
            self._settle(outcome)

    def _settle(self, outcome: Decoded | PayloadError) -> None:
        i = len(self.done)
        self.done.append(outcome)
        if self.on_done is not None:
            self.on_done(i, outcome)

    def finish(self) -> list[Decoded | PayloadError]:
        return self.cut(PayloadError("SIZE_MISMATCH", "the batch's stream ended before this reply"))

    def cut(self, error: PayloadError) -> list[Decoded | PayloadError]:
        """The replies so far, `error` for the one being received, and for every later one."""
        later = PayloadError("BATCH_CUT", f"an earlier reply of the batch was rejected ({error.code})")
        if len(self.done) < len(self.decoders):
            self._settle(error)
        while len(self.done) < len(self.decoders):
            self._settle(later)
        return self.done
