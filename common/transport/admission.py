"""Admission: who may register, and how refusals are reported without letting a flood of
them become a flood of run.db rows and log lines (issue 17, item 3).

- `takeover_refusal`: a node id that a live child holds cannot be registered again from
  another address; the old process must first be marked dead by the liveness monitor
  (common/transport/liveness.py), after which the new one registers normally.  (Re-registering from the
  same address, e.g. a retried registration whose reply was lost, moves nothing.)
- `EventThrottle`: at most one event per (kind, peer) per interval; refusals inside the
  interval are counted and the count is carried by the next event for that peer (or by
  `flush`).  Peers are keyed by host, not host:port, so reconnecting does not reset the count;
  the number of peers remembered is bounded, and so is the number of events of one kind per
  interval (`EVENTS_PER_INTERVAL`): past it, the refusals of every further peer are folded into
  one event per interval with their count, so 500 invented node ids are a few rows of run.db.
- `RequestGate`: an incoming request's method and caller are checked on its header frame,
  before any of its data is read or allocated (common/wire/codec.py `FrameDecoder.admit`), and the
  request is bounded by its method: a method that carries no tensors (declared `request="empty"`) may
  declare no data bytes; one that carries the model at most `MODEL_COPIES` copies of the
  receiving process's model per logical client it hosts (`state_set`) or per message, plus
  `REQUEST_SLACK`.  A refused request is answered with a typed error (UNKNOWN_METHOD,
  NOT_ALLOWED, TOO_LARGE) and its data never read.
- `CallSlots`: how many calls a gRPC server runs at once, in three lanes of its worker threads:
  data calls (Exchange, Call), registrations (Register) and quick control calls (Heartbeat,
  Probe), each with a global cap and a per-caller cap, so no flood in one lane takes the
  threads of another: heartbeats are answered while insiders hold slow streams or slow
  registrations open (common/transport/grpc.py).  Only an authenticated parent (a call that
  proves its registration key, `RegistrationKeys`) is exempt from the data lane's limits.
- `ReadDeadline`: a control call whose request has not arrived within `CONTROL_READ_SECONDS` is
  cancelled, so a slow sender holds a thread of its lane for seconds, not for the run.
- `RegistrationKeys`: a registrant proves it serves at the address it claims.  Each Register
  carries a fresh random key; the parent probes the claimed address (`Probe`, with a nonce) and
  the process serving there must answer with an HMAC of the nonce and node id under that key,
  which only the process that sent the registration holds.  The parent's later calls carry a
  proof of the key (`PARENT_META`): how a child tells its parent from a caller that merely
  claims the parent's node id (a shared run token lets any participant claim it).
- `LogThrottle`: a logging filter that lets one line per message template per interval through
  and carries the count of those it held back, so a flood of refused calls is a few log lines.
"""
from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable, Mapping

from fedhop.common.util.text import one_line as one_line  # where the project's other modules import it from
from fedhop.common.wire.codec import PayloadError
from fedhop.common.wire.methods import Method

if TYPE_CHECKING:
    import torch

    from fedhop.common.transport.router import MethodRouter
    from fedhop.common.wire import fedhop_pb2 as pb

Emit = Callable[[str, str, str], None]   # (kind, node, detail)
MAX_PEERS = 4096
EVENTS_PER_INTERVAL = 16   # events of one kind per interval before further peers' are folded into one


# the refusals an edge reports to the server in its heartbeats (edge/reports.py); the server records
# these kinds from an edge, and "events_dropped" (the edge's queue overflowed), nothing from a client process
EDGE_EVENT_KINDS = frozenset({"register_refused", "auth_refused", "call_refused", "request_refused"})


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
    """One event per (kind, peer) per `interval` seconds, with a count of the ones folded in; at
    most `per_interval` events of one kind per interval, the rest folded into one overflow event
    (node "*") per kind and interval that says how many refusals of how many peers it stands for."""

    def __init__(self, emit: Emit, interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 per_interval: int = EVENTS_PER_INTERVAL) -> None:
        self.emit, self.interval, self.clock, self.per_interval = emit, interval, clock, per_interval
        self._seen: OrderedDict[tuple[str, str], list] = OrderedDict()   # key -> [since, folded, node, detail]
        self._budget: dict[str, list] = {}    # kind -> [window start, events emitted in it]
        self._overflow: dict[str, list] = {}  # kind -> [refusals, peers, last node, last detail]
        self._lock = threading.Lock()

    def __call__(self, kind: str, peer: str, node: str, detail: str) -> None:
        now = self.clock()
        key = (kind, peer)
        out: list[tuple[str, str, str]] = []
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                entry[2], entry[3] = node, detail
                return
            budget = self._budget.setdefault(kind, [now, 0])
            if now - budget[0] >= self.interval:   # a new window: report the last one's overflow first
                out.extend(self._take_overflow(kind))
                budget[0], budget[1] = now, 0
            folded = entry[1] if entry is not None else 0
            if budget[1] >= self.per_interval:     # over this kind's events per interval: fold
                over = self._overflow.setdefault(kind, [0, 0, node, detail])
                over[0] += 1 + folded
                over[1] += 1
                over[2], over[3] = node, detail
                self._seen.pop(key, None)
            else:
                budget[1] += 1
                self._seen[key] = [now, 0, node, detail]
                self._seen.move_to_end(key)
                while len(self._seen) > MAX_PEERS:
                    self._seen.popitem(last=False)
                out.append((kind, node, detail + self._more(folded, peer)))
        for event in out:
            self.emit(*event)

    def _take_overflow(self, kind: str) -> list[tuple[str, str, str]]:
        over = self._overflow.pop(kind, None)
        if over is None:
            return []
        return [(kind, "*", f"{over[0]} more {kind} from {over[1]} further peers within {self.interval:g}s "
                            f"(over {self.per_interval} events per {self.interval:g}s); the last: "
                            f"{over[2]}: {over[3]}")]

    def flush(self) -> None:
        """Report the refusals folded since each peer's last event, and the overflow."""
        with self._lock:
            pending = [(kind, peer, e[1], e[2], e[3]) for (kind, peer), e in self._seen.items() if e[1]]
            for kind, peer, *_ in pending:
                self._seen[(kind, peer)][1] = 0
            overflow = [event for kind in list(self._overflow) for event in self._take_overflow(kind)]
        for kind, peer, folded, node, detail in pending:
            self.emit(kind, node, detail + self._more(folded, peer))
        for event in overflow:
            self.emit(*event)

    def _more(self, folded: int, peer: str) -> str:
        return f" (+{folded} more from {peer} within {self.interval:g}s)" if folded else ""


# ----------------------------------------------------------------------------- requests
# a method's request size class is its declaration's `request` (common/wire/methods.py): "empty" requests
# carry no tensors (an empty Payload, scalars or control data at most), "per_client" ones one state per
# logical client the receiver hosts, "model" ones a model message


def __getattr__(name: str) -> frozenset[Method]:
    """`EMPTY_REQUESTS` and `PER_CLIENT_REQUESTS`: the methods declared so far of each size class."""
    size = {"EMPTY_REQUESTS": "empty", "PER_CLIENT_REQUESTS": "per_client"}.get(name)
    if size is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return frozenset(m for m in Method if m.request == size)

MODEL_COPIES = 8                 # a model message: the model plus the algorithm's extras (control variates, a
#                                  snapshot), possibly in a wider wire dtype (float64 for a float32 model)
REQUEST_SLACK = 16 << 20         # scalars packed as tensors, small extra tensors


def model_bytes(params: Mapping[str, "torch.Tensor"]) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())


def request_bounds(model: int, clients: int) -> Callable[[Method], int]:
    """The most data bytes a request of each method may declare to a process whose model has
    `model` bytes and that hosts (or aggregates) `clients` logical clients."""
    def bound(method: Method) -> int:
        if method.request == "empty":
            return 0
        copies = MODEL_COPIES * (max(1, clients) if method.request == "per_client" else 1)
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
        if method is not None and method.request == "empty":   # whatever the model: these carry no tensors
            return 0
        bound = self.bounds()
        if method is None or bound is None:
            return 1 << 62
        return bound(method)


# ----------------------------------------------------------------------------- calls at once
CONTROL_PER_PEER = 2     # registrations of one caller at once
QUICK_PER_PEER = 2       # heartbeats (and probes) of one caller at once
CONTROL_READ_SECONDS = 5.0   # a control call's request (a few hundred bytes) must arrive within this
LANES = {"Register": "control", "Heartbeat": "quick", "Probe": "quick"}   # RPC -> lane; any other: "data"


def lane_of(method: str) -> str:
    """The lane of an RPC (its last path component): "data", "control" or "quick"."""
    return LANES.get(method, "data")


def lane_sizes(workers: int) -> dict[str, int]:
    """How `workers` gRPC threads are split: registrations at most max(2, workers // 8) at once,
    max(2, workers // 8) reserved for heartbeats and probes (which may also take a free data
    slot), data calls the rest (at least 1)."""
    control = quick = max(2, workers // 8)
    return {"control": control, "quick": quick, "data": max(1, workers - control - quick)}


class CallSlots:
    """How many calls a gRPC server runs at once, per lane, in all and per caller.

    `workers` threads serve every RPC, split in lanes (`lane_sizes`): data calls (Exchange,
    Call), registrations (Register) and quick control calls (Heartbeat, Probe).  No call takes
    the threads of the registration or the quick lane but their own, so a flood of slow
    registrations or streams cannot keep a heartbeat from its thread; a quick call finding its
    lane full takes a free data slot if there is one (heartbeats come in bursts).  Per caller (its authenticated node id): `per_peer` data calls,
    `CONTROL_PER_PEER` registrations, `QUICK_PER_PEER` heartbeats.  Exempt from the data
    lane's limits: this process's parent (which sends one call per sampled client at once and
    is what the process serves), but only where the call proves it (`parent = True`: it carries
    the proof of this process's registration key, `RegistrationKeys.parent_proven`) and
    `privileged` accepts the node; and an unidentified caller ("": a process with no
    credentials trusts its network).  The control lanes' caps hold for every caller.  A call
    over a limit is refused at once (RESOURCE_EXHAUSTED), before its request is read: it never
    waits for a thread."""

    def __init__(self, workers: int, per_peer: int | None = None) -> None:
        self.lanes = lane_sizes(workers)
        self.capacity = self.lanes["data"]
        self.per_peer = per_peer if per_peer is not None else max(1, self.capacity // 4)
        self.privileged: Callable[[str], bool] = lambda node: False
        self._held: dict[tuple[str, str], int] = {}
        self._lane: dict[str, int] = {"data": 0, "control": 0, "quick": 0}
        self._lock = threading.Lock()
        self.refused = 0

    def acquire(self, peer: str, kind: str = "data", parent: bool = False) -> str | None:
        """Take a slot of lane `kind` ("data" | "control" | "quick") for `peer`; `parent`: the call
        proved this process's registration key.  The reason it was refused, or None."""
        return self.take(peer, kind, parent)[0]

    def take(self, peer: str, kind: str = "data", parent: bool = False) -> tuple[str | None, tuple]:
        """`acquire`, also returning the slot's ticket for `release_slot`: the per-caller key (the
        proven parent's calls are held apart: they never count against a caller that merely
        claims its node id) and the lane charged (a quick call may borrow a data slot)."""
        with self._lock:
            exempt = kind == "data" and (not peer or parent and self.privileged(peer))
            key = ("parent" if exempt and peer else kind, peer)
            held = self._held.get(key, 0)
            cap = {"data": self.per_peer, "control": CONTROL_PER_PEER, "quick": QUICK_PER_PEER}[kind]
            lane = kind
            if kind == "quick" and self._lane["quick"] >= self.lanes["quick"] \
                    and self._lane["data"] < self.lanes["data"]:
                lane = "data"
            if exempt:
                refusal = None
            elif self._lane[lane] >= self.lanes[lane]:
                refusal = f"all {self.lanes[kind]} {kind} call slots are busy"
            elif peer and held >= cap:
                refusal = f"{peer} already holds {held} {kind} calls (the per-caller limit)"
            else:
                refusal = None
            if refusal is not None:
                self.refused += 1
                return refusal, (key, lane)
            self._held[key] = held + 1
            self._lane[lane] += 1
            return None, (key, lane)

    def release(self, peer: str, kind: str = "data", parent: bool = False) -> None:
        """Give back a data or control slot taken by `acquire(peer, kind, parent)` (with the same
        `privileged`)."""
        exempt = kind == "data" and bool(peer) and parent and self.privileged(peer)
        self.release_slot((("parent" if exempt else kind, peer), kind))

    def release_slot(self, ticket: tuple) -> None:
        """Give back the slot of a `take` ticket."""
        key, lane = ticket
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
            self._lane[lane] -= 1

    def held(self, kind: str = "data") -> int:
        with self._lock:
            return sum(n for (k, _), n in self._held.items() if k == kind)


class ReadDeadline:
    """Cancels calls whose request has not arrived in time: `arm(seconds, cancel)` before a
    control call's request is read, `disarm(ticket)` once it is in.  One daemon thread for all."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.cancelled = 0

    def arm(self, seconds: float, cancel: Callable[[], object]) -> int:
        with self._cond:
            ticket = next(self._ids)
            self._armed[ticket] = cancel
            heapq.heappush(self._heap, (time.monotonic() + seconds, ticket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="fedhop-read-deadline")
                self._thread.start()
            self._cond.notify()
            return ticket

    def disarm(self, ticket: int) -> None:
        with self._cond:
            self._armed.pop(ticket, None)

    def _run(self) -> None:
        while True:
            due: list[Callable[[], object]] = []
            with self._cond:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                at, ticket = self._heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                due.append(self._armed.pop(ticket))
            for cancel in due:
                self.cancelled += 1
                try:
                    cancel()
                except Exception:   # the call ended meanwhile
                    pass


    def reset(self) -> None:
        """Forget every deadline and the thread (a forked child has none of its parent's threads)."""
        self._heap, self._armed = [], {}
        self._cond = threading.Condition()
        self._thread = None


READ_DEADLINES = ReadDeadline()


# ----------------------------------------------------------------------------- registration keys
PARENT_META = "fedhop-parent"   # metadata: the parent's proof of a child's registration key
PROBE_SECONDS = 5.0             # how long a parent waits for a registrant's probe answer
KEYS_KEPT = 4                   # registration keys a process remembers per node id


def key_id(key: bytes) -> bytes:
    """Which registration key a probe asks about: the first 8 bytes of its SHA-256."""
    return hashlib.sha256(key).digest()[:8]


def probe_proof(key: bytes, nonce: bytes, target: str) -> bytes:
    """The answer to a probe: HMAC-SHA256 under the registration key of the nonce and node id."""
    return hmac.new(key, b"fedhop-probe\0" + nonce + b"\0" + target.encode(), hashlib.sha256).digest()


def parent_proof(key: bytes, child: str) -> str:
    """What a parent's calls to `child` carry (PARENT_META): an HMAC of the child's node id under
    the key of the child's registration, which only the child and the parent that took the
    registration hold."""
    return hmac.new(key, b"fedhop-parent\0" + child.encode(), hashlib.sha256).hexdigest()


class RegistrationKeys:
    """The keys of this process's own registrations, per node id (the last KEYS_KEPT: a retried
    or repeated registration has a fresh one, and calls of the parent that took an earlier one
    may still be in flight).  Process-wide, as the process is what serves at its address: any
    of its endpoints answers a probe about a registration any of them sent."""

    def __init__(self) -> None:
        self._keys: dict[str, deque[bytes]] = {}
        self._lock = threading.Lock()

    def issue(self, node_id: str) -> bytes:
        key = secrets.token_bytes(32)
        with self._lock:
            self._keys.setdefault(node_id, deque(maxlen=KEYS_KEPT)).append(key)
        return key

    def answer(self, target: str, wanted: bytes, nonce: bytes) -> bytes:
        """The probe answer for the registration of `target` whose key has id `wanted`; b"" when
        this process sent no such registration."""
        with self._lock:
            keys = list(self._keys.get(target, ()))
        key = next((k for k in keys if hmac.compare_digest(key_id(k), wanted)), None)
        return probe_proof(key, nonce, target) if key is not None else b""

    def parent_proven(self, node_id: str, value: str) -> bool:
        """Whether `value` (a call's PARENT_META) proves a key of one of `node_id`'s registrations."""
        if not value:
            return False
        with self._lock:
            keys = list(self._keys.get(node_id, ()))
        return any(hmac.compare_digest(parent_proof(k, node_id), value) for k in keys)


    def reset(self) -> None:
        """Forget every key (a forked child registers with its own)."""
        self._keys, self._lock = {}, threading.Lock()


REGISTRATION_KEYS = RegistrationKeys()
# a child forked from a process that served (the launcher's fork start, deploy/launch/forkstart.py) starts
# with neither its deadline thread nor its keys


def _after_fork() -> None:
    READ_DEADLINES.reset()
    REGISTRATION_KEYS.reset()


os.register_at_fork(after_in_child=_after_fork)


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
