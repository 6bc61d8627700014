"""Admission: who may register, and how refusals are reported without letting a flood of
them become a flood of run.db rows and log lines (issue 17, item 3).

- `takeover_refusal`: a node id that a live child holds cannot be registered again from
  another address; the old process must first be marked dead by the liveness monitor
  (common/transport/liveness.py), after which the new one registers normally.  (Re-registering from the
  same address, e.g. a retried registration whose reply was lost, moves nothing.)
- `EventThrottle`: at most one event per (kind, peer) per interval; refusals inside the
  interval are counted and the count is carried by the next event for that peer (or by
  `flush`).  Peers are keyed by host, not host:port, so reconnecting does not reset the count;
  the number of peers remembered is bounded.
- `RequestGate`: an incoming request's method and caller are checked on its header frame,
  before any of its data is read or allocated (common/wire/codec.py `FrameDecoder.admit`), and the
  request is bounded by its method: a method that carries no tensors (`EMPTY_REQUESTS`) may
  declare no data bytes; one that carries the model at most `MODEL_COPIES` copies of the
  receiving process's model per logical client it hosts (`state_set`) or per message, plus
  `REQUEST_SLACK`.  A refused request is answered with a typed error (UNKNOWN_METHOD,
  NOT_ALLOWED, TOO_LARGE) and its data never read.
- `CallSlots`: per-peer limits on the Exchange/Call streams a gRPC server runs at once, with
  `RESERVED_WORKERS` worker threads that data calls can never take, so heartbeats and
  registrations are answered while one participant holds slow streams open
  (common/transport/grpc.py).
- `LogThrottle`: a logging filter that lets one line per message template per interval through
  and carries the count of those it held back, so a flood of refused calls is a few log lines.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Mapping

from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.methods import Method

if TYPE_CHECKING:
    import torch

    from fedhop.common.transport.router import MethodRouter
    from fedhop.common.wire import fedhop_pb2 as pb

Emit = Callable[[str, str, str], None]   # (kind, node, detail)
MAX_PEERS = 4096


def peer_host(peer: str) -> str:
    """gRPC's `context.peer()` ("ipv4:127.0.0.1:5555", "ipv6:[::1]:5555") without the port."""
    if peer.count(":") >= 2:
        return peer.rsplit(":", 1)[0]
    return peer


def takeover_refusal(node_id: str, address: str, live_address: str | None) -> str | None:
    """A refusal when `node_id` is held by a live child at another address; None otherwise."""
    if live_address is None or live_address == address:
        return None
    return (f"NODE_TAKEN: node id {node_id} is live at {live_address}; a registration from {address} may take it "
            f"over only after that process is marked dead (no heartbeat for security.heartbeat_timeout)")


class EventThrottle:
    """One event per (kind, peer) per `interval` seconds, with a count of the ones folded in."""

    def __init__(self, emit: Emit, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.emit, self.interval, self.clock = emit, interval, clock
        self._seen: OrderedDict[tuple[str, str], list] = OrderedDict()   # key -> [since, folded, node, detail]
        self._lock = threading.Lock()

    def __call__(self, kind: str, peer: str, node: str, detail: str) -> None:
        now = self.clock()
        key = (kind, peer)
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                entry[2], entry[3] = node, detail
                return
            folded = entry[1] if entry is not None else 0
            self._seen[key] = [now, 0, node, detail]
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_PEERS:
                self._seen.popitem(last=False)
        self.emit(kind, node, detail + self._more(folded, peer))

    def flush(self) -> None:
        """Report the refusals folded since each peer's last event."""
        with self._lock:
            pending = [(kind, peer, e[1], e[2], e[3]) for (kind, peer), e in self._seen.items() if e[1]]
            for kind, peer, *_ in pending:
                self._seen[(kind, peer)][1] = 0
        for kind, peer, folded, node, detail in pending:
            self.emit(kind, node, detail + self._more(folded, peer))

    def _more(self, folded: int, peer: str) -> str:
        return f" (+{folded} more from {peer} within {self.interval:g}s)" if folded else ""


# ----------------------------------------------------------------------------- requests
# methods whose requests carry no tensors (an empty Payload, scalars or control data at most)
EMPTY_REQUESTS = frozenset({Method.PING, Method.SHUTDOWN, Method.STATE_GET, Method.SEQ_QUERY, Method.SEQ_FINAL,
                            Method.TORCH_PROCS})
# methods whose request carries one state per logical client the receiver hosts
PER_CLIENT_REQUESTS = frozenset({Method.STATE_SET, Method.SEQ_RESTORE})
MODEL_COPIES = 8                 # a model message: the model plus the algorithm's extras (control variates, a
#                                  snapshot), possibly in a wider wire dtype (float64 for a float32 model)
REQUEST_SLACK = 16 << 20         # scalars packed as tensors, small extra tensors


def model_bytes(params: Mapping[str, "torch.Tensor"]) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())


def request_bounds(model: int, clients: int) -> Callable[[Method], int]:
    """The most data bytes a request of each method may declare to a process whose model has
    `model` bytes and that hosts (or aggregates) `clients` logical clients."""
    def bound(method: Method) -> int:
        if method in EMPTY_REQUESTS:
            return 0
        copies = MODEL_COPIES * (max(1, clients) if method in PER_CLIENT_REQUESTS else 1)
        return copies * model + REQUEST_SLACK
    return bound


class RequestGate:
    """Checks an incoming request's header before its data is read (module docstring).

    `router()` gives the process's MethodRouter (a process still registering waits for it, as
    its handler would), or None (then only the method's size class applies); `router` itself
    None: the process serves no Exchange calls (the server).  `bounds()` gives the per-method bound once the model is known
    (None: the endpoint's general limit).  A refusal raises PayloadError before any data frame
    is accepted; a refused method or caller also goes through the router's refusal (log line,
    `not_allowed` event hook), as `MethodRouter.dispatch` would; with no router, `on_refused`."""

    def __init__(self, router: "Callable[[], MethodRouter | None] | None",
                 bounds: Callable[[], Callable[[Method], int] | None] = lambda: None,
                 on_refused: "Callable[[pb.Envelope, str, str], None] | None" = None) -> None:
        self.router, self.bounds, self.on_refused = router, bounds, on_refused
        self.refused = 0

    def __call__(self, env: "pb.Envelope") -> int:
        from fedhop.common.transport.base import HandlerError, Request
        from fedhop.common.transport.router import NOT_ALLOWED, UNKNOWN_METHOD, allowed
        from fedhop.common.wire.message import Payload
        method = Method.parse(env.method)
        if self.router is None:
            self.refused += 1
            reason = f"'{env.method}' from '{env.src}' ({int(env.data_bytes)} data bytes declared) refused on its " \
                     f"header: this process serves no Exchange calls"
            if self.on_refused is not None:
                self.on_refused(env, UNKNOWN_METHOD, reason)
            raise PayloadError(UNKNOWN_METHOD, reason)
        router = self.router()
        if router is not None:
            if method is None or method not in router.methods:
                code, reason = UNKNOWN_METHOD, f"{router.owner} does not serve '{env.method}'"
            elif not allowed(method, env.src, router.peers):
                who = " or ".join(sorted(c.value for c in method.callers))
                code, reason = NOT_ALLOWED, (f"{router.owner} obeys '{method}' only from its {who} "
                                             f"(parent: {router.peers.parent}), not from '{env.src}'")
            else:
                code = reason = ""
            if code:
                self.refused += 1
                try:   # the router's own refusal: its log line and its event hook
                    router._refuse(Request(env, Payload()), code, reason)
                except HandlerError:
                    pass
                raise PayloadError(code, reason)
        if method in EMPTY_REQUESTS:   # whatever the model: these carry no tensors
            return 0
        bound = self.bounds()
        if method is None or bound is None:
            return 1 << 62
        return bound(method)


# ----------------------------------------------------------------------------- calls at once
RESERVED_WORKERS = 4     # gRPC worker threads data calls never take: heartbeats and registrations
CONTROL_PER_PEER = 4     # registrations and heartbeats of one caller at once


class CallSlots:
    """How many calls a gRPC server runs at once, in all and per caller.

    `workers` threads serve every RPC.  Data calls (Exchange, Call) may hold at most
    `workers - RESERVED_WORKERS` of them, so a heartbeat or a registration always finds a
    thread; one caller (its authenticated node id) at most `per_peer` of those, except the nodes
    `privileged` accepts (this process's parent, which sends one call per sampled client at once
    and is what the process serves) and an unidentified caller (""): a process with no
    credentials trusts its network.  Control calls (Register, Heartbeat) are short: at most
    `CONTROL_PER_PEER` at once per caller (a slow-sending one cannot pile up).  A call over a
    limit is refused at once (RESOURCE_EXHAUSTED), before its request is read: it never waits
    for a thread."""

    def __init__(self, workers: int, per_peer: int | None = None) -> None:
        self.capacity = max(1, workers - RESERVED_WORKERS)
        self.per_peer = per_peer if per_peer is not None else max(1, self.capacity // 4)
        self.privileged: Callable[[str], bool] = lambda node: False
        self._held: dict[tuple[str, str], int] = {}
        self._data = 0
        self._lock = threading.Lock()
        self.refused = 0

    def acquire(self, peer: str, kind: str = "data") -> str | None:
        """Take a slot of `kind` ("data" | "control") for `peer`; the reason it was refused, or None."""
        key = (kind, peer)
        with self._lock:
            held = self._held.get(key, 0)
            if kind == "control":
                refusal = (f"{peer} already has {held} registrations or heartbeats in flight"
                           if peer and held >= CONTROL_PER_PEER else None)
            elif not peer or self.privileged(peer):
                refusal = None
            elif self._data >= self.capacity:
                refusal = f"all {self.capacity} call slots are busy"
            elif held >= self.per_peer:
                refusal = f"{peer} already holds {held} calls (the per-caller limit)"
            else:
                refusal = None
            if refusal is not None:
                self.refused += 1
                return refusal
            self._held[key] = held + 1
            if kind == "data":
                self._data += 1
            return None

    def release(self, peer: str, kind: str = "data") -> None:
        key = (kind, peer)
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
            if kind == "data":
                self._data -= 1

    def held(self, kind: str = "data") -> int:
        with self._lock:
            return sum(n for (k, _), n in self._held.items() if k == kind)


# ----------------------------------------------------------------------------- log lines
class LogThrottle(logging.Filter):
    """At most one WARNING-or-lower record per (logger, message template) per `interval`; the
    next one let through says how many were held back.  Errors always pass."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval, self.clock = interval, clock
        self._seen: OrderedDict[tuple[str, str], list] = OrderedDict()   # key -> [since, held back]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                return False
            held = entry[1] if entry is not None else 0
            self._seen[key] = [now, 0]
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_PEERS:
                self._seen.popitem(last=False)
        if held:
            record.msg = f"{record.msg} (+{held} more like this within {self.interval:g}s)"
        return True


# the loggers whose lines a hostile peer can trigger by the thousand (refused calls and registrations)
REFUSAL_LOGGERS = ("fedhop.security", "fedhop.protocol")


def throttle_refusal_logs(interval: float = 10.0) -> LogThrottle:
    """Install one LogThrottle on the loggers of refusals (a role's main calls it once)."""
    throttle = LogThrottle(interval)
    for name in REFUSAL_LOGGERS:
        logging.getLogger(name).addFilter(throttle)
    return throttle
