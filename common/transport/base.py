"""The transport interface the roles use (DESIGN.md sections 2 and 3).

A process owns one `Endpoint`: it serves incoming calls through a `Handler` and makes outgoing
calls with `call`.  Every message in either direction is recorded in the process's ledger by
the endpoint itself, so the roles and the algorithms never count bytes by hand.  Two
implementations share this contract: gRPC (real sockets, `common.transport.grpc`) and an
in-memory one for unit tests (`fedhop.transports.inmemory`) that runs the same codec, so both
give the same bits and the same byte counts.
"""
from __future__ import annotations

import dataclasses
import hmac
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence, cast

from fedhop.common.transport.admission import key_id, probe_proof
from fedhop.common.transport.placement import to_device
from fedhop.common.util.text import MAX_ERROR_TEXT, one_line
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.codec import (
    FRAME_OVERHEAD,
    Decoded,
    Encoded,
    FrameDecoder,
    PayloadError,
    ReplyBound,
    bundle_framing,
    encode,
    frame_framing,
    make_envelope,
)
from fedhop.common.wire.ledger import Ledger, LedgerRecord
from fedhop.common.wire.message import Payload
from fedhop.common.wire.methods import message_link, role_of

if TYPE_CHECKING:
    import torch

    from fedhop.common.transport.liveness import LivenessMonitor


@dataclass(frozen=True)
class _Sizes:
    tensor_bytes: int
    payload_bytes: int
    framed_bytes: int


NOTHING_SENT = _Sizes(0, 0, 0)   # the ledger's sizes of a request that never reached the wire


@dataclass(frozen=True)
class _Refusal:
    """A handler's typed refusal or failure (`Endpoint._handle`): the reply's error code and
    message, and the record's error text."""

    code: str
    detail: str
    error: str


@dataclass(frozen=True)
class _Taken:
    """A served request as it was read (`Endpoint._take`): decoded, or refused with what of it
    arrived (`decoded` None when not even its header did), its link and its decoding's seconds."""

    decoded: Decoded | None
    link: str
    seconds: float
    refused: PayloadError | None = None
    placed: bool = False   # its payload's tensors already moved to the endpoint's device (`serve_batch`)


class RemoteError(RuntimeError):
    """The peer answered with an error (it rejected our message or failed to handle it).  Its
    code and text are the peer's own: kept one bounded line (`one_line`), as they go into the
    logs and run.db."""

    def __init__(self, code: str, message: str, peer: str = "") -> None:
        code, message = one_line(code, 64), one_line(message, MAX_ERROR_TEXT)
        super().__init__(f"{peer or 'peer'} replied {code}: {message}")
        self.code = code
        self.detail = message
        self.peer = peer


class CallFailed(RuntimeError):
    """The call did not complete: peer unreachable, deadline exceeded, connection dropped.
    `delivered` False: it failed before any byte of the request reached the wire (never connected)."""

    delivered = True

    def __init__(self, code: str, message: str, peer: str = "") -> None:
        super().__init__(f"call to {peer or 'peer'} failed ({code}): {message}")
        self.code = code
        self.detail = message
        self.peer = peer


@dataclass
class Request:
    """An incoming call as a handler sees it."""

    envelope: pb.Envelope
    payload: Payload


# A handler returns the reply payload, or raises PayloadError / HandlerError for a typed error reply.
Handler = Callable[[Request], Payload]
# The role's answer to a child's Register call (served when `Endpoint.serve` is given one).
RegisterHandler = Callable[[pb.RegisterRequest], pb.RegisterReply]
# (caller, method, reason, peer address) of a served call refused because its caller is over its share
BusyHook = Callable[[str, str, str, str], None]


class HandlerError(RuntimeError):
    """A handler refuses a call with a typed error (`code`); the message, which may quote the
    caller's input, is kept one bounded line."""

    def __init__(self, code: str, message: str) -> None:
        code, message = one_line(code, 64), one_line(message, MAX_ERROR_TEXT)
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message


def _checked_link(env: pb.Envelope) -> str:
    """The ledger link of a received message (`control` where its ends are not both named);
    ends that are named must be node ids (server, edge-N, client-N), the link is worked out
    from them."""
    if not (env.src and env.dst):
        return "control"
    try:
        return message_link(env.src, env.dst, env.method)
    except ValueError:
        raise PayloadError("MALFORMED_HEADER", f"src {env.src[:64]!r} and dst {env.dst[:64]!r} must be node ids "
                                               f"(server, edge-N, client-N)") from None


def _link_or_control(env: pb.Envelope) -> str:
    """The ledger link of a received message, or `control` for one whose ends name no nodes."""
    try:
        return _checked_link(env)
    except PayloadError:
        return "control"


_ROLE_ORDER = {"server": 0, "edge": 1, "client": 2}   # down the tree: server, edges, clients


def direction_of(src: str, dst: str) -> str:
    a, b = _ROLE_ORDER.get(role_of(src), 3), _ROLE_ORDER.get(role_of(dst), 3)
    if a == b:
        return "peer"
    return "down" if a < b else "up"


def reply_problem(reply: pb.Envelope, request: pb.Envelope) -> tuple[str, str] | None:
    """(code, message) when a reply's envelope does not answer `request`: another run, another
    round (a replayed old result), another sender or method.  An error reply the callee made
    for a request it could not decode (method "error") carries no routing and is not checked."""
    if reply.HasField("error") and reply.method == "error":
        return None
    if request.run_id and reply.run_id != request.run_id:
        return "WRONG_RUN", f"{_answering(request)} is for run '{reply.run_id}', not '{request.run_id}'"
    if reply.round != request.round or reply.step != request.step:
        return "STALE_ROUND", f"{_answering(request)} is for round {reply.round} step {reply.step}, not round " \
                              f"{request.round} step {request.step}"
    if reply.src != request.dst:
        return "WRONG_SENDER", f"{_answering(request)} says it comes from '{reply.src}'"
    if reply.method != request.method + ".reply":
        return "BAD_METHOD", f"{_answering(request)} is a '{reply.method}' message"
    return None


def _answering(request: pb.Envelope) -> str:
    """How `reply_problem` names a reply that does not answer `request` (made only for one)."""
    return f"reply to {request.method} (round {request.round}) from {request.dst}"


@dataclass(frozen=True)
class Batched:
    """One request of `Endpoint.call_many`: to logical node `dst`, its frames cut once; `step`
    its envelope's step (None: the batch's), so that requests of different steps (an
    asynchronous dispatch's own minibatch stream) share a call."""

    dst: str
    method: str
    prepared: Encoded
    expect: "ReplyBound | None" = None
    step: int | None = None

    def step_or(self, batch_step: int) -> int:
        """The step its envelope carries: its own, else the batch's."""
        return batch_step if self.step is None else self.step


# -- framing: the gRPC framing bytes each message counts (common/transport/grpc.py) ------------
# Decided here, from sizes alone, so that the gRPC transport and the in-memory one (which moves
# no bytes but records what gRPC would) count the same framed bytes for every message.

def pulls_reply(decoder: FrameDecoder, chunk_bytes: int) -> bool:
    """Whether a call's reply is pulled (grpc.py module docstring, Pulled replies): it takes a
    streaming fold's receive slot (`decoder.gate`) and may span more than one chunk."""
    return getattr(decoder, "gate", None) is not None and decoder.max_payload_bytes > chunk_bytes


def sent_bundled(request: Encoded, chunk_bytes: int, pulled: bool) -> bool:
    """Whether a request goes as one unary `Call` (its frames in one FrameBundle): one of at
    most one chunk whose reply is not pulled; any other streams as `Exchange`."""
    return not pulled and request.payload_bytes <= chunk_bytes


def pulled_framing(frames: int) -> int:
    """A pulled request's framing: each of its `frames` is a gRPC message (5 bytes), and so is
    the empty go message that lets the reply's data come."""
    return FRAME_OVERHEAD * (frames + 1)


def request_framing(request: Encoded, chunk_bytes: int, pulled: bool) -> int | None:
    """The framing bytes a request of one call counts on both ends: the bundle's (a 5-byte
    prefix, a tag and a length varint per frame) when it goes bundled, `pulled_framing` when its
    reply is pulled; None for a plain stream, whose frames count 5 bytes each (the codec's
    default, `Encoded.framed_bytes`)."""
    if sent_bundled(request, chunk_bytes, pulled):
        return bundle_framing(request.frame_lengths())
    return pulled_framing(len(request.frames)) if pulled else None


def shares_one_call(requests: Sequence[Batched], chunk_bytes: int) -> bool:
    """Whether `call_many` carries `requests` in one call (a batch): two or more whose payloads
    together are at most one chunk; otherwise each goes as its own call."""
    return len(requests) >= 2 and sum(r.prepared.payload_bytes for r in requests) <= chunk_bytes


def one_by_one(count: int, send: Callable[[int], Payload],
               on_each: Callable[[int, Payload | Exception], None] | None) -> list[Payload | Exception]:
    """`send(i)` for each of `count` requests in order, each result a Payload or the typed
    exception its call raised, passed to `on_each` as soon as it is known (`Endpoint.call_many`)."""
    out: list[Payload | Exception] = []
    for i in range(count):
        result: Payload | Exception
        try:
            result = send(i)
        except (CallFailed, RemoteError, PayloadError) as exc:
            result = exc
        out.append(result)
        if on_each is not None:
            on_each(i, result)
    return out


def batch_calls(sizes: Sequence[int], chunk_bytes: int) -> list[range]:
    """The calls a batch's messages go in, given each message's bytes with its own header: runs
    of consecutive messages of at most one chunk together (a message larger than that alone), so
    that every call's bundle is a request the callee reads whole (`GrpcEndpoint.request_bound`).
    The messages' headers (run, source, destination, token) are not in the bytes the fabric
    grouped by (`Fabric._batches`), so a group filled to one chunk may need two calls."""
    calls: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > chunk_bytes:
            calls.append(range(start, i))
            start, total = i, 0
        total += size
    calls.append(range(start, len(sizes)))
    return calls


REPLIES_PER_BUNDLE = 16   # replies of a batch that share one gRPC message at most (`ReplyBundles`; transport.reply_bundle)


class ReplyBundles:
    """How the replies of one batch call travel (common/transport/grpc.py, Batches): back to back
    in `FrameBundle` messages, as the request did, instead of one gRPC message per frame.  A reply
    opens a new bundle when the open one already holds `per_bundle` replies or when the reply's
    frames would take it over `limit` bytes (one chunk); the frames of a reply larger than that
    go in as many bundles as keep each within `limit` (a frame alone may fill one).  The rule
    reads only the replies' frame sizes, so both ends of a call (and the in-memory transport,
    which serves the same batch in one process) place each reply alike: `place` gives, per
    frame, whether it opens a bundle, and the reply's framing, its frames' tags and length
    varints plus the 5-byte gRPC prefix of each bundle it opens.  A bundle is sent when it is
    full by count, or when the next reply does not fit it, or at the call's end: at most
    `per_bundle` replies wait for each other, so an early reply still reaches the caller before
    the batch's last one is computed (a round deadline keeps the replies already in)."""

    def __init__(self, limit: int, per_bundle: int = REPLIES_PER_BUNDLE) -> None:
        self.limit = limit
        self.per_bundle = max(1, per_bundle)
        self.size = 0     # bytes in the open bundle
        self.count = 0    # replies in the open bundle (0: none is open)

    def place(self, frame_lengths: Sequence[int]) -> tuple[list[bool], int]:
        costs = [n + frame_framing([n]) for n in frame_lengths]
        fresh = self.count == 0 or self.count >= self.per_bundle or self.size + sum(costs) > self.limit
        opens: list[bool] = []
        framing = 0
        for k, (n, cost) in enumerate(zip(frame_lengths, costs)):
            start = fresh if k == 0 else self.size + cost > self.limit
            if start:
                self.size, self.count = 0, 0
                framing += FRAME_OVERHEAD
            opens.append(start)
            self.size += cost
            framing += cost - n
        self.count += 1
        return opens, framing

    @property
    def full(self) -> bool:
        """The open bundle takes no further reply: send it now."""
        return self.count >= self.per_bundle


def batch_framing(i: int, frame_lengths: Iterable[int]) -> int:
    """Message `i`'s share of a batch's one FrameBundle: its frames' tags and length varints,
    and for the first message also the bundle's 5-byte gRPC prefix, so the shares add up to what
    the call put on the wire.  A bundle of one message is its first: `bundle_framing`."""
    return frame_framing(frame_lengths) + (FRAME_OVERHEAD if i == 0 else 0)


class Endpoint(ABC):
    """One process's transport endpoint."""

    def __init__(self, node_id: str, ledger: Ledger, run_id: str = "", token: str = "",
                 chunk_bytes: int = 4 << 20, max_payload_bytes: int = 1 << 31) -> None:
        self.node_id = node_id
        self.ledger = ledger
        self.run_id = run_id
        self.token = token
        self.chunk_bytes = chunk_bytes
        self.replies_per_bundle = REPLIES_PER_BUNDLE   # a served batch's replies per gRPC message (transport.reply_bundle)
        self.max_payload_bytes = max_payload_bytes
        self.checksum = True    # XXH3-64 of the tensor bytes in every message sent (security.checksum)
        # ... and required of every message with tensor bytes received (CHECKSUM_MISSING): off until
        # the role knows its run's config (`use_checksum`), which a child learns only at registration
        self.require_checksum = False
        # transport.wire_compression: what the gRPC transport compresses its calls with ("none" elsewhere)
        self.wire_compression = "none"
        self.liveness: LivenessMonitor | None = None    # a parent's LivenessMonitor (common/transport/liveness.py): heartbeats, registrations
        # what a registration waits for before anything is done with it, the address probe included:
        # None to go on, else the refusal (an edge holds its clients until it knows its run: edge/runtime.py)
        self.registration_wait: Callable[[pb.RegisterRequest], str | None] | None = None
        # an incoming request's method, caller and size checked on its header frame, before its data
        # is read (common/transport/admission.py `RequestGate`); None: only `max_payload_bytes` bounds it
        self.request_gate: Callable[[pb.Envelope], int] | None = None
        # a served request whose data the process takes only when it has room for it: called with the
        # request's header and a "caller still there" check, it waits and returns the release of what
        # it took (or None); the transport reads the data after it (client/host.py `request_hold`)
        self.request_hold: Callable[[pb.Envelope, Callable[[], bool]], Callable[[], None] | None] | None = None
        # told of a batch's decoded requests before any is handled (client/host.py `prepare_batch`:
        # [algorithm] vectorized trains the batch's clients together); None: nothing to prepare
        self.before_batch: Callable[[list[Request]], None] | None = None
        self.device: torch.device | None = None   # where received tensors are placed (common/transport/placement.py); None: the CPU
        self.on_busy: BusyHook | None = None       # told of each call refused by a transport that limits calls per caller

    def use_checksum(self, on: bool) -> None:
        """The run's `security.checksum`: the XXH3-64 trailer on every message sent, and required of
        every message with tensor bytes received (a sender or a hop cannot turn the check off)."""
        self.checksum = self.require_checksum = on

    # -- outgoing -------------------------------------------------------------------
    def prepare(self, payload: Payload) -> Encoded:
        """Cut a payload into frames once (send it to many peers with `call(..., prepared=)`)."""
        return encode(payload, pb.Envelope(), self.chunk_bytes, self.checksum)

    def call(self, address: str, dst: str, method: str, payload: Payload | None = None, *,
             round: int, step: int = 0, timeout: float, prepared: Encoded | None = None,
             link: str | None = None, expect: ReplyBound | None = None) -> Payload:
        """Send `payload` to node `dst` at `address`, wait for its reply, record both messages.
        `expect`: the most the reply may declare (data bytes, header bytes), enforced as it arrives."""
        env = make_envelope(run_id=self.run_id, round=round, step=step, src=self.node_id, dst=dst,
                            method=method, token=self.token)
        if prepared is None:
            prepared = encode(payload if payload is not None else Payload(), pb.Envelope(), self.chunk_bytes,
                              self.checksum)
        request = prepared.with_header(env)
        return self._call_message(address, request, link or message_link(self.node_id, dst, method), timeout,
                                  expect)

    def _call_message(self, address: str, request: Encoded, link: str, timeout: float,
                      expect: ReplyBound | None) -> Payload:
        """`call` of a request already under its envelope: exchange it, record both messages."""
        started = time.perf_counter()
        try:
            decoded, sent_seconds = self._exchange(address, request, timeout, self._decoder(expect))
        except CallFailed as exc:   # recorded as lost, with the bytes that reached the wire
            self._record(request.envelope, request if exc.delivered else NOTHING_SENT, "sender", link,
                         time.perf_counter() - started, status="lost", error=str(exc))
            raise
        except PayloadError as exc:   # the reply could not be decoded (corrupt, truncated, hostile)
            # the request arrived; its reply did not: the loss is recorded on the request's record
            # (the reply's msg_id is the request's + ".reply", so a consistency check can pair them)
            self._record(request.envelope, request, "sender", link, time.perf_counter() - started,
                         error=f"reply rejected: {exc}")
            env = request.envelope
            raise PayloadError(exc.code, f"reply of {env.dst} to {env.method} (round {env.round}): {exc.detail}") \
                from None
        self._record(request.envelope, request, "sender", link, sent_seconds)
        return self._settle(request, decoded, link, time.perf_counter() - started - sent_seconds)

    def _settle(self, request: Encoded, decoded: Decoded, link: str, seconds: float) -> Payload:
        """Record a call's reply and return its payload; a reply that does not answer the request
        (PayloadError) or an error reply (RemoteError) raises."""
        dst = request.envelope.dst
        env_r = decoded.envelope
        problem = reply_problem(env_r, request.envelope)
        error = (f"{problem[0]}: {problem[1]}" if problem else
                 f"{env_r.error.code}: {env_r.error.message}" if env_r.HasField("error") else "")
        expected_id = f"{request.envelope.msg_id}.reply"
        if problem and env_r.msg_id != expected_id:   # a replayed or forged reply: record it as the reply due
            error += f" (the reply claims msg_id '{env_r.msg_id}')"
        self._record(env_r, decoded, "receiver", link, seconds,
                     status="rejected" if problem or env_r.HasField("error") else "ok", error=error,
                     msg_id=expected_id if problem else None)
        if problem:
            raise PayloadError(*problem)
        if env_r.HasField("error"):
            raise RemoteError(env_r.error.code, env_r.error.message, dst)
        return to_device(decoded.payload, self.device)

    def batch_messages(self, requests: Sequence[Batched], *, round: int, step: int) -> tuple[list[Encoded], list[range]]:
        """A batch's messages, each under its own header, and the calls they go in (`batch_calls`),
        each message's framing set to its share of its call's bundle (`batch_framing`)."""
        msgs = [req.prepared.with_header(make_envelope(run_id=self.run_id, round=round,
                                                       step=req.step_or(step),
                                                       src=self.node_id, dst=req.dst, method=req.method,
                                                       token=self.token))
                for req in requests]
        calls = batch_calls([m.payload_bytes for m in msgs], self.chunk_bytes)
        for call in calls:
            for j, i in enumerate(call):
                msgs[i].framing = batch_framing(j, msgs[i].frame_lengths())
        return msgs, calls

    def call_many(self, address: str, requests: Sequence[Batched], *, round: int, step: int = 0,
                  timeout: float, on_each: Callable[[int, Payload | Exception], None] | None = None
                  ) -> list[Payload | Exception]:
        """Several requests to the logical clients of one process at `address`: each its own
        message (envelope, msg_id, ledger records on both ends), and each result a Payload or the
        exception its call would have raised (CallFailed, RemoteError, PayloadError).  `on_each(i,
        result)` is called once per request as soon as its result is known, in request order (the
        caller need not wait for the whole batch).  Here one call each; a transport that can carry
        several messages in one call overrides it."""
        return one_by_one(len(requests), lambda i: self.call(
            address, requests[i].dst, requests[i].method, round=round,
            step=requests[i].step_or(step), timeout=timeout,
            prepared=requests[i].prepared, expect=requests[i].expect), on_each)

    def probe_request(self, request: pb.RegisterRequest) -> tuple[pb.ProbeRequest, str]:
        """The probe of a registration's claimed address (grpc.py module docstring, Addresses
        proved): a fresh nonce under the registration's key id, and the probe's msg_id."""
        nonce = secrets.token_bytes(16)
        probe = pb.ProbeRequest(target=request.node_id, nonce=nonce, key_id=key_id(request.proof_key),
                                run_id=self.run_id, parent=self.node_id)
        return probe, f"probe-{request.node_id}-{nonce.hex()}"

    def probe_outcome(self, request: pb.RegisterRequest, probe: pb.ProbeRequest, reply: pb.ProbeReply,
                      msg_id: str, seconds: float, unproven: str, there: str) -> str | None:
        """Record a probe and its reply (two `control` messages) and check the proof: None when
        the reply proves the registration's key, else the refusal; `there` names an answerer
        that gave no node id."""
        target = request.node_id
        self.record_control("probe", self.node_id, target, probe.ByteSize(), "sender", seconds, msg_id, self.run_id)
        self.record_control("probe.reply", target, self.node_id, reply.ByteSize(), "receiver", seconds,
                            msg_id + ".reply", self.run_id)
        if not hmac.compare_digest(reply.proof, probe_proof(request.proof_key, probe.nonce, target)):
            who = f"node '{reply.node_id}'" if reply.node_id else there
            return f"{unproven}: {who} does not hold this registration's key"
        return None

    def register(self, address: str, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:
        """Unary Register call to a parent, counted as two `control` messages."""
        if not request.msg_id:
            request.msg_id = f"register-{request.node_id}-{time.time_ns()}"
        msg_id = request.msg_id
        started = time.perf_counter()
        reply = self._register_rpc(address, request, timeout)
        seconds = time.perf_counter() - started
        parent = reply.node_id or "parent"
        self.record_control("register", request.node_id, parent, request.ByteSize(), "sender", seconds,
                            msg_id, reply.run_id)
        self.record_control("register.reply", parent, request.node_id, reply.ByteSize(), "receiver",
                            seconds, msg_id + ".reply", reply.run_id)
        return reply

    def record_control(self, method: str, src: str, dst: str, size: int, role: str, seconds: float,
                       msg_id: str, run_id: str) -> None:
        self.ledger.record(run_id=run_id, round=0, step=0, src=src, dst=dst, link="control",
                           direction="control", method=method, tensor_bytes=0, payload_bytes=size,
                           framed_bytes=size + 5, seconds=seconds, recorder=self.node_id, role=role,
                           msg_id=msg_id, status="ok", wall_time=time.time(), error="")

    def heartbeat(self, address: str, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        """A child's liveness beacon to its parent (common/transport/liveness.py), counted as two `control` messages."""
        raise CallFailed("UNIMPLEMENTED", f"{type(self).__name__} carries no heartbeats", address)

    def handle_registration(self, register_handler: RegisterHandler, request: pb.RegisterRequest) -> pb.RegisterReply:
        """Run the role's Register handler; tell the liveness monitor about accepted children."""
        if self.registration_wait is not None:
            held = self.registration_wait(request)
            if held is not None:
                return pb.RegisterReply(accepted=False, message=held, node_id=self.node_id)
        if self.liveness is not None:
            refusal = self.liveness.check_registration(request)
            if refusal is not None:
                self.liveness.refused(request, refusal)
                return pb.RegisterReply(accepted=False, message=refusal, node_id=self.node_id)
        reply = register_handler(request)
        if not reply.accepted and self.liveness is not None:
            self.liveness.refused(request, reply.message)
        if reply.accepted and self.liveness is not None:
            self.liveness.registered(request)
        return reply

    @abstractmethod
    def _register_rpc(self, address: str, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply: ...

    def _decoder(self, expect: ReplyBound | None) -> FrameDecoder:
        """A decoder for one reply: the endpoint's limit, or the caller's tighter bound."""
        if expect is None:
            return FrameDecoder(max_payload_bytes=self.max_payload_bytes, require_checksum=self.require_checksum)
        decoder = FrameDecoder(max_payload_bytes=min(expect.data_bytes, self.max_payload_bytes),
                               max_header_bytes=expect.header_bytes, require_checksum=self.require_checksum)
        decoder.gate = getattr(expect, "gate", None)   # type: ignore[attr-defined]  # read back with getattr (grpc.py); a streaming fold's receive slots (common/processors/streaming.py)
        decoder.buffers = getattr(getattr(expect, "gate", None), "receive_buffers", None)   # a large reply into a file (common/wire/filebacked.py)
        return decoder

    @abstractmethod
    def _exchange(self, address: str, request: Encoded, timeout: float,
                  decoder: FrameDecoder) -> tuple[Decoded, float]:
        """Move the request frames, feed the reply's frames to `decoder`; return the decoded reply
        and the seconds spent sending."""

    # -- incoming -------------------------------------------------------------------
    def serve_frames(self, frames, handler: Handler, framing: int | None = None, pulled: bool = False,
                     on_header: Callable[[pb.Envelope], Callable[[], None] | None] | None = None,
                     reply_framing: Callable[[list[int]], int] | None = None) -> Sequence[bytes]:
        """Decode an incoming message, run the handler, encode the reply (shared by transports).
        `framing`: the request's gRPC framing bytes when it arrived bundled (codec.bundle_framing).
        `pulled`: the request's stream stays open after its data for one more (empty) message,
        the caller's go for the reply (common/transport/grpc.py, Pulled replies): the frames are
        read until the message is complete, and that message counts in the request's framing.
        `on_header`: called once the header frame is in, before any data frame is read (the
        transport's taken requests); what it returns is called when the handler is done.
        `reply_framing`: the reply's gRPC framing bytes from its frame lengths, where it travels
        bundled (a batch's reply, `ReplyBundles`); None: streamed, 5 bytes a frame."""
        held: list[Callable[[], None]] = []
        try:
            return self._serve(frames, handler, framing, pulled, on_header, held, reply_framing)
        finally:
            for release in held:
                release()

    def serve_batch(self, messages: Sequence[tuple[Sequence[bytes], int | None, Callable[[list[int]], int] | None]],
                    handler: Handler) -> Iterator[Sequence[bytes]]:
        """A batch's requests served in order, one reply's frames yielded per request, with the same
        replies and records as `serve_frames` on each in turn; each request comes with its frames,
        its share of the call's framing and its reply's `reply_framing` (`serve_frames`).

        Every request is decoded first, so that the handlers (a client's training) are not each
        preceded by the decoding of another message (docs/performance.md, "The same work in
        phases"); then each is handled, its reply encoded and both recorded, so a request's records
        follow its own handler, as a reader of the process's ledger expects.  A batch's requests
        are within one chunk (transport.chunk_bytes, `Fabric._batches`), so holding them decoded
        costs about that."""
        taken: list[_Taken | None] = [self._take(frames, framing, False, None, []) for frames, framing, _ in messages]
        self._tell_batch(taken)
        for i, (_, _, reply_framing) in enumerate(messages):
            request, taken[i] = taken[i], None   # answered: its request's memory goes with it
            assert request is not None
            yield self._answer(request, handler, reply_framing)

    def _tell_batch(self, taken: list["_Taken | None"]) -> None:
        """`before_batch` told of a batch's decoded requests, their tensors moved to the
        endpoint's device (each marked placed, so its handler does not move them again)."""
        if self.before_batch is None:
            return
        requests = []
        for i, t in enumerate(taken):
            if t is not None and t.decoded is not None and t.refused is None:
                t.decoded.payload = to_device(t.decoded.payload, self.device)
                taken[i] = dataclasses.replace(t, placed=True)
                requests.append(Request(t.decoded.envelope, t.decoded.payload))
        self.before_batch(requests)

    def _serve(self, frames, handler: Handler, framing: int | None, pulled: bool,
               on_header: Callable[[pb.Envelope], Callable[[], None] | None] | None,
               held: list[Callable[[], None]],
               reply_framing: Callable[[list[int]], int] | None = None) -> Sequence[bytes]:
        return self._answer(self._take(frames, framing, pulled, on_header, held), handler, reply_framing)

    def _take(self, frames, framing: int | None, pulled: bool,
              on_header: Callable[[pb.Envelope], Callable[[], None] | None] | None,
              held: list[Callable[[], None]]) -> "_Taken":
        """An incoming request decoded (or refused: its error and what of it arrived)."""
        started = time.perf_counter()
        decoder = FrameDecoder(max_payload_bytes=self.max_payload_bytes, admit=self.request_gate,
                               require_checksum=self.require_checksum)

        def arrived_framing() -> int | None:   # a pulled request's go is one more gRPC message
            return pulled_framing(decoder.frames) if pulled else framing

        try:
            for frame in frames:
                decoder.feed(frame)
                if on_header is not None and decoder.envelope is not None:
                    release = on_header(decoder.envelope)   # may wait: the data stays with its sender
                    on_header = None
                    if release is not None:
                        held.append(release)
                if pulled and decoder.complete:
                    break
            decoded = decoder.finish()
            link = _checked_link(decoded.envelope)
        except PayloadError as exc:
            env = decoder.envelope
            if env is None:   # not even a header: answered by an unrouted error reply
                return _Taken(None, "", 0.0, exc)
            # the header arrived (the data was corrupt or short): the rejected message is recorded
            # and answered with a routed typed error, so both ledgers pair the request and its reply
            seen = Decoded(envelope=env, payload=Payload(), payload_bytes=decoder.payload_bytes,
                           frames=decoder.frames, tensor_bytes=int(env.data_bytes), framing=arrived_framing())
            return _Taken(seen, _link_or_control(env), time.perf_counter() - started, exc)
        decoded.framing = arrived_framing()
        return _Taken(decoded, link, time.perf_counter() - started)

    def _answer(self, taken: _Taken, handler: Handler,
                reply_framing: Callable[[list[int]], int] | None) -> Sequence[bytes]:
        """A taken request's reply frames: its handler's reply, or the typed error that refused it;
        the request and the reply recorded."""
        return self._reply(taken, self._handle(taken, handler), reply_framing)

    def _handle(self, taken: _Taken, handler: Handler) -> "Payload | _Refusal | None":
        """A taken request's handler run: its reply, the refusal it raised, or None for a request
        refused before its handler."""
        decoded = taken.decoded
        if decoded is None or taken.refused is not None:
            return None
        try:
            payload = decoded.payload if taken.placed else to_device(decoded.payload, self.device)
            return handler(Request(decoded.envelope, payload))
        except (PayloadError, HandlerError) as exc:
            return _Refusal(exc.code, exc.detail, str(exc))
        except Exception as exc:  # a bug or a failed local computation: typed reply, never a crash
            return _Refusal("HANDLER_FAILED", f"{type(exc).__name__}: {exc}", str(exc))

    def _reply(self, taken: _Taken, outcome: "Payload | _Refusal | None",
               reply_framing: Callable[[list[int]], int] | None) -> Sequence[bytes]:
        """The reply's frames for a handled request (`_handle`'s outcome), the request and the
        reply recorded."""
        decoded, link, refused = taken.decoded, taken.link, taken.refused
        if decoded is None:
            assert refused is not None
            return self._error_reply(None, refused.code, refused.detail).frames
        env = decoded.envelope
        if refused is not None:
            reply = self._error_reply(env, refused.code, refused.detail)
            self._record(env, decoded, "receiver", link, taken.seconds, status="rejected", error=str(refused))
        else:
            status, error = "ok", ""
            try:
                if isinstance(outcome, _Refusal):
                    reply, status, error = self._error_reply(env, outcome.code, outcome.detail), "rejected", outcome.error
                else:
                    reply = encode(cast(Payload, outcome), self._reply_envelope(env), self.chunk_bytes, self.checksum)
            except (PayloadError, HandlerError) as exc:
                reply = self._error_reply(env, exc.code, exc.detail)
                status, error = "rejected", str(exc)
            except Exception as exc:  # a reply the codec cannot encode (an unsupported dtype): typed, never a crash
                reply = self._error_reply(env, "HANDLER_FAILED", f"{type(exc).__name__}: {exc}")
                status, error = "rejected", str(exc)
            self._record(env, decoded, "receiver", link, taken.seconds, status=status, error=error)
        if reply_framing is not None:
            reply.framing = reply_framing(reply.frame_lengths())
        self._record(reply.envelope, reply, "sender", link, 0.0)
        return reply.frames

    def _reply_envelope(self, env: pb.Envelope) -> pb.Envelope:
        return make_envelope(run_id=env.run_id, round=env.round, step=env.step, src=env.dst or self.node_id,
                             dst=env.src, method=env.method + ".reply", token=self.token,
                             msg_id=f"{env.msg_id}.reply" if env.msg_id else None)

    def _error_reply(self, env: pb.Envelope | None, code: str, message: str) -> Encoded:
        out = (self._reply_envelope(env) if env is not None else
               make_envelope(run_id=self.run_id, round=0, src=self.node_id, dst="", method="error"))
        out.error.code = code
        out.error.message = message
        return encode(Payload(), out, self.chunk_bytes, self.checksum)

    def _record(self, env: pb.Envelope, msg: Encoded | Decoded | _Sizes, role: str, link: str, seconds: float,
                status: str = "ok", error: str = "", msg_id: str | None = None) -> None:
        src, dst = env.src, env.dst
        # made here, not through `Ledger.record`'s check of its keyword names (these are the
        # record's fields): every message is recorded on both of its ends
        self.ledger.add(LedgerRecord(
            run_id=env.run_id, round=env.round, step=env.step, src=src, dst=dst, link=link,
            direction=direction_of(src, dst) if link != "control" else "control", method=env.method,
            tensor_bytes=msg.tensor_bytes, payload_bytes=msg.payload_bytes, framed_bytes=msg.framed_bytes,
            seconds=seconds, recorder=self.node_id, role=role, msg_id=msg_id or env.msg_id, status=status,
            wall_time=time.time(), error=error))

    # -- lifecycle ------------------------------------------------------------------
    @abstractmethod
    def serve(self, handler: Handler, bind: str, register_handler: RegisterHandler | None = None) -> str:
        """Start serving (Register calls too when `register_handler` is given); return the address
        peers use to reach this endpoint."""

    @abstractmethod
    def stop(self) -> None: ...
