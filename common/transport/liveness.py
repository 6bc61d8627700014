"""Liveness: heartbeats from children, dead-node detection at parents, re-registration with
exponential backoff and full jitter (docs/faults.md).

- A child (client process, edge) runs a `HeartbeatSender`: one `Heartbeat` call to its parent
  every `security.heartbeat_interval` seconds.  When the parent answers `known = false` (it marked
  the child dead, or it restarted) the child registers again; when the parent stays unreachable
  for `security.parent_timeout` seconds the child gives up and exits, so a dead server never
  leaves its children running.
- A parent (server, edge) runs a `LivenessMonitor`: it remembers every registered child, and a
  child silent for `security.heartbeat_timeout` seconds after a heartbeat is marked dead (a child
  starts beating once it is ready to train, so slow start-up is not taken for death): the calls in flight to
  it are cancelled at once (they fail with NODE_DEAD instead of running into the round timeout),
  later calls fail without touching the network, and an event is reported.  The round goes on
  with the results it has (run.min_results decides).  A dead child comes back by registering.
- Registrations: `check_registration` refuses, before any call is made, a node id live at
  another address, an address a live other node holds and clients a live other node hosts;
  what passes is then proved (common/transport/grpc.py, "Addresses proved"): the parent probes
  the claimed address and the process serving there must answer under the registration's own
  key.  So a dead node's address is free for its restart and for whoever proves to serve there,
  never for a registrant that only names it, and a second registration of a live node id from
  its own address is accepted only from the process that serves there.
- `Backoff`: delay before retry k is uniform(0, min(cap, base * 2**k)) ("full jitter", the AWS
  architecture blog's "Exponential Backoff And Jitter"; Flower's RetryInvoker default), drawn
  from the named stream ("backoff", node id) so runs stay reproducible.

Heartbeats are not ledger messages: a sender killed between the parent's receipt and its own
ledger write would leave a receiver-only record; their count and bytes are in summary.json's
`liveness` section instead.
"""
from __future__ import annotations

import bisect
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Callable, Mapping, Sequence

from fedhop.common.security.addresses import host_of
from fedhop.common.transport.admission import EventThrottle, one_line, takeover_refusal
from fedhop.common.transport.base import CallFailed, role_of
from fedhop.common.transport.livebytes import TIERS, counts_fit
from fedhop.common.util.rng import numpy_stream
from fedhop.common.util.views import IndexedView
from fedhop.common.wire import fedhop_pb2 as pb

log = logging.getLogger("fedhop.liveness")

FATAL_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED")
MISMATCH_TRIES, MISMATCH_SECONDS = 3, 2.0   # a TLS mismatch ends registration once it held this long
MAX_GRACE = 60.0   # seconds: the most a pause of the parent itself extends its children's timeout
EventHook = Callable[[str, str, str], None]   # (kind, node, detail)


class Backoff:
    """Full-jitter exponential backoff: delay(k) ~ U(0, min(cap, base * 2**k))."""

    def __init__(self, base: float = 0.2, cap: float = 5.0, name: str = "node", seed: int = 0) -> None:
        if base <= 0 or cap < base:
            raise ValueError(f"backoff: need 0 < base <= cap, got base={base}, cap={cap}")
        self.base, self.cap = base, cap
        self._rng = numpy_stream(seed, "backoff", name)

    def ceiling(self, attempt: int) -> float:
        return min(self.cap, self.base * 2.0 ** min(attempt, 60))

    def delay(self, attempt: int) -> float:
        return float(self._rng.uniform(0.0, self.ceiling(attempt)))


# ----------------------------------------------------------------------------- registration
def connection_hint(address: str, exc: CallFailed, tls: bool) -> str:
    """A sentence on the likely cause of a failed call to `address` (plaintext vs TLS, refused).

    A mismatch is named only on evidence: gRPC's TLS stack reporting the handshake, or a TLS
    handshake of our own with the parent (`_serves_tls`).  An open port alone is none: a plaintext
    parent under load also fails a call with UNAVAILABLE while its port accepts connections."""
    detail = (exc.detail or "").lower()
    if exc.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return (f"{address} refused this node's credential ({exc.detail}); check the cluster secret "
                f"(FEDHOP_TOKEN / cluster.secret) or the node certificate")
    if tls and (any(k in detail for k in ("ssl", "handshake", "tls", "certificate"))
                or exc.code == "UNAVAILABLE" and "socket closed" in detail and _serves_tls(address)):
        # a server that wants a client certificate (mutual TLS) just closes the socket on us
        return (f"the TLS handshake with {address} failed ({exc.detail}): the parent may serve plaintext "
                f"(then run this process without --certs-dir, with --insecure off loopback), it requires a client "
                f"certificate from this cluster's CA (mutual TLS), or its certificate is not from this cluster's CA")
    if not tls and exc.code == "UNAVAILABLE" and _serves_tls(address):
        return (f"{address} serves TLS and this process speaks plaintext gRPC. Give this "
                f"process the cluster certificates (--certs-dir DIR from `fedhop certs`), or, on a trusted network, "
                f"run the parent in plaintext (the server: no security.certs_dir; off loopback every process "
                f"with --insecure)")
    return f"cannot reach {address} ({exc.code}: {exc.detail})"


def _serves_tls(address: str, timeout: float = 1.0) -> bool:
    """Whether `address` answers a TLS handshake.  Nothing is verified: the server's certificate
    is not trusted for anything, only its answering in TLS at all is asked.  A plaintext gRPC
    server answers a ClientHello with HTTP/2 bytes (WRONG_VERSION_NUMBER) or by closing; a
    server that wants a client certificate still completes TLS 1.3's handshake or sends an alert,
    which is TLS too."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        port = int(address.rsplit(":", 1)[1])
        with socket.create_connection((host_of(address), port), timeout=timeout) as raw, context.wrap_socket(raw):
            return True
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
        return False
    except ssl.SSLError as exc:
        return exc.reason not in ("WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE")
    except (OSError, ValueError, IndexError):
        return False


def add_parent_args(ap, what: str) -> None:
    """--parent HOST:PORT, or --parent-file PATH: a file the parent writes its address to once it
    serves (the local launcher starts every process at once, so their imports overlap)."""
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--parent", help=f"address of the {what} to register with")
    group.add_argument("--parent-file", help=f"read the {what}'s address from this file, waiting for it to appear")


def resolve_parent(args, timeout: float = 120.0) -> str:
    """The parent's address from --parent, or from --parent-file once the parent has written it
    (the writer replaces the file atomically, so a present file is complete)."""
    if args.parent:
        return args.parent
    path = Path(args.parent_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            host, _, port = text.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--parent-file {path}: expected HOST:PORT, found {text!r}")
            return text
        time.sleep(0.02)
    raise TimeoutError(f"--parent-file {path}: no parent address within {timeout:.0f}s (did the parent start?)")


def register_with_backoff(endpoint, parent: str, request: pb.RegisterRequest, *, deadline_s: float = 60.0,
                          backoff: Backoff | None = None, call_timeout: float = 10.0,
                          tls: bool = False) -> pb.RegisterReply:
    """Register with `parent`, retrying unreachable parents with full-jitter backoff until
    `deadline_s`; a refused credential fails at once.  Raises RuntimeError with a clear message."""
    backoff = backoff or Backoff(name=request.node_id)
    start = time.monotonic()
    attempt = mismatches = 0
    first_mismatch = start
    while True:
        try:
            return endpoint.register(parent, request, call_timeout)
        except CallFailed as exc:
            hint = connection_hint(parent, exc, tls)
            if exc.code in FATAL_CODES:
                raise RuntimeError(f"{request.node_id}: registration refused: {hint}") from None
            # plaintext against TLS (or the reverse) does not heal by waiting: stop once it held
            # for MISMATCH_TRIES tries over MISMATCH_SECONDS (a gRPC channel repeats its last error
            # until its reconnect backoff has passed: at most 2 s, GrpcEndpoint.channel)
            if "TLS" in hint and "cannot reach" not in hint:
                mismatches += 1
                if mismatches == 1:
                    first_mismatch = time.monotonic()
                if mismatches >= MISMATCH_TRIES and time.monotonic() - first_mismatch >= MISMATCH_SECONDS:
                    raise RuntimeError(f"{request.node_id}: cannot register with {parent}: {hint}") from None
            else:
                mismatches = 0
            left = deadline_s - (time.monotonic() - start)
            if left <= 0:
                raise RuntimeError(f"{request.node_id}: could not register with {parent} within {deadline_s:.0f}s: "
                                   f"{hint}") from None
            delay = min(backoff.delay(attempt), left)
            log.warning("register with %s failed (%s: %s); retry %d in %.2fs", parent, exc.code, exc.detail,
                        attempt + 1, delay)
            time.sleep(delay)
            attempt += 1


# ----------------------------------------------------------------------------- the child side
class HeartbeatSender:
    """A child's heartbeat loop (a daemon thread); see the module docstring."""

    def __init__(self, endpoint, parent: str, *, interval: float, parent_timeout: float,
                 reregister: Callable[[], object], on_give_up: Callable[[str], None],
                 backoff: Backoff | None = None,
                 counts: Callable[[], list[pb.LinkBytes]] | None = None,
                 events: "Callable[[], list[pb.NodeEvent]] | None" = None) -> None:
        self.endpoint = endpoint
        self.counts = counts    # live byte totals to carry (common/transport/livebytes.py)
        self.events = events    # this node's own events for the server's run.db (an edge's refusals)
        self.parent = parent
        self.interval = interval
        self.parent_timeout = parent_timeout
        self.reregister = reregister
        self.on_give_up = on_give_up
        self.backoff = backoff or Backoff(name=endpoint.node_id)
        self.sent = 0
        self.reregistrations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"heartbeat-{endpoint.node_id}")

    def start(self) -> "HeartbeatSender":
        self._thread.start()
        return self

    def stop(self, wait: bool = False, final: bool = False) -> None:
        """Stop beating; with `wait`, also let a heartbeat in flight finish first (a child told
        to shut down does this before it replies, so that every heartbeat is on its parent's
        ledger before the run's ledgers are merged).  With `final`, then send one last heartbeat
        carrying the final byte totals, so the parent's live view ends equal to the final table."""
        self._stop.set()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(self.interval, 1.0) + 1.0)
        if final and self._thread.ident is not None and not self._thread.is_alive():
            try:
                self._beat()
            except CallFailed as exc:
                log.warning("last heartbeat to %s failed: %s %s", self.parent, exc.code, exc.detail)

    def _beat(self) -> bool:
        """One heartbeat; True when the parent knows us (False: re-register)."""
        self.sent += 1
        req = pb.HeartbeatRequest(node_id=self.endpoint.node_id, run_id=self.endpoint.run_id, seq=self.sent,
                                  sent_at=time.time(), bytes=self.counts() if self.counts is not None else (),
                                  events=self.events() if self.events is not None else ())
        reply = self.endpoint.heartbeat(self.parent, req, timeout=max(self.interval, 1.0))
        return reply.known

    def _run(self) -> None:
        last_ok = time.monotonic()
        attempt = 0
        while not self._stop.wait(self.interval if attempt == 0 else self.backoff.delay(attempt)):
            try:
                known = self._beat()
                if not known:
                    log.warning("%s does not know %s any more: registering again", self.parent, self.endpoint.node_id)
                    self.reregister()
                    self.reregistrations += 1
                last_ok = time.monotonic()
                attempt = 0
            except CallFailed as exc:
                silent = time.monotonic() - last_ok
                if exc.code in FATAL_CODES or silent > self.parent_timeout:
                    why = (f"parent {self.parent} unreachable for {silent:.1f}s (security.parent_timeout = "
                           f"{self.parent_timeout}s): {exc.code} {exc.detail}") if exc.code not in FATAL_CODES \
                        else f"parent {self.parent} refused us: {exc.code} {exc.detail}"
                    log.error("giving up: %s", why)
                    self.on_give_up(why)
                    return
                attempt += 1
            except RuntimeError as exc:   # re-registration refused
                log.error("giving up: %s", exc)
                self.on_give_up(str(exc))
                return


# ----------------------------------------------------------------------------- the parent side
# seconds a child may take after its registration to send its first heartbeat (it builds its
# task and model first); one that never beats, killed during its set-up, is dead after this
# plus the heartbeat timeout
SETUP_GRACE = 60.0


@dataclass
class ChildLiveness:
    node_id: str
    address: str
    clients: list[int]
    last_seen: float | None          # None until its first heartbeat (a child beats once it is ready)
    registered_at: float = 0.0       # when it registered: a child that never beats is dead SETUP_GRACE later
    dead: bool = False
    dead_since: float | None = None
    beats: int = 0
    suspected_at: float | None = None   # a call to it failed then (no heartbeat since): dead a timeout later
    suspect_reason: str = ""


@dataclass
class LivenessStats:
    heartbeats_received: int = 0
    heartbeat_bytes: int = 0          # serialized request + reply, plus 5 bytes gRPC framing each
    unknown_heartbeats: int = 0
    marked_dead: int = 0
    detection_seconds: list[float] = field(default_factory=list)   # silence at the moment of marking
    reregistrations: int = 0


def reports_for(sender: str, node: str, me: str) -> bool:
    """Whether a heartbeat from `sender` may carry byte totals of `node`: its own, or (an edge
    relaying) those of a node below it; never this parent's own."""
    if node == me:
        return False
    return node == sender or TIERS.get(role_of(node), -1) > TIERS.get(role_of(sender), 99)


class LivenessMonitor:
    """A parent's view of its children (module docstring).  `clock` is injectable for tests."""

    def __init__(self, endpoint, interval: float, timeout: float, on_event: EventHook | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout <= interval:
            raise ValueError(f"heartbeat timeout ({timeout}) must exceed the interval ({interval})")
        self.endpoint = endpoint
        self.interval = interval
        self.timeout = timeout
        self.on_event = on_event
        self.clock = clock
        self.children: dict[str, ChildLiveness] = {}
        self.stats = LivenessStats()
        self.on_bytes: Callable[[list[pb.LinkBytes]], object] | None = None   # a heartbeat's live byte totals
        self.on_events: Callable[[str, list[pb.NodeEvent]], None] | None = None   # (sender, its events): known nodes'
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refusals = EventThrottle(self._event, interval=max(10.0, timeout))
        self._last_check: float | None = None
        endpoint.liveness = self

    # -- registrations ------------------------------------------------------------------
    def check_registration(self, req: pb.RegisterRequest) -> str | None:
        """A refusal when the request claims logical clients that a live other node hosts, or names
        one client twice (DUPLICATE_CLIENT), or a node id that a live child at another address
        holds (NODE_TAKEN), or the address of a live child with another node id (ADDRESS_TAKEN:
        an address is owned by one live node, so a registration there cannot redirect that
        node's liveness verdict, `mark_dead`, or the name its TLS channel expects); None
        otherwise.  These cost no call; a registration that passes must still prove it serves
        at its address (the parent's probe, common/transport/grpc.py), so the address of a dead
        node goes only to a process that serves there."""
        ids = [c.client_id for c in req.clients]
        twice = sorted(c for c, n in Counter(ids).items() if n > 1)
        if twice:
            return f"DUPLICATE_CLIENT: client ids {twice[:10]} listed twice by {req.node_id}"
        with self._lock:
            held = self.children.get(req.node_id)
            taken = takeover_refusal(req.node_id, req.address, held.address if held and not held.dead else None)
            if taken:
                return taken
            owner = next((c.node_id for c in self.children.values()
                          if c.address == req.address and c.node_id != req.node_id and not c.dead), None)
            if owner is not None:
                return (f"ADDRESS_TAKEN: {req.address} is the address of live node {owner}; {req.node_id} may "
                        f"register there only after {owner} is marked dead (no heartbeat for "
                        f"security.heartbeat_timeout)")
            claimed = set(ids)
            for child in self.children.values():
                if child.node_id == req.node_id or child.dead:
                    continue
                hosted = sorted(claimed.intersection(child.clients))
                if hosted:
                    return (f"DUPLICATE_CLIENT: clients {hosted[:10]} are hosted by live node {child.node_id}; "
                            f"{req.node_id} may take them only after that node is marked dead")
        return None

    def refused(self, req: pb.RegisterRequest, reason: str) -> None:
        """A registration refused (here, by the probe of its address, or by the parent's
        handler): one event per claimed node per interval, and at most EVENTS_PER_INTERVAL of
        them per interval, the rest counted in one (common/transport/admission.py)."""
        node = one_line(req.node_id, 200)   # the caller's words (unauthenticated without credentials)
        self._refusals("register_refused", node, node, one_line(f"{req.role} at {req.address}: {reason}", 2000))

    def registered(self, req: pb.RegisterRequest) -> None:
        with self._lock:
            old = self.children.get(req.node_id)
            if old is not None and old.dead:
                self.stats.reregistrations += 1
            # clients that move to this node leave their old (dead) host
            moved = {c.client_id for c in req.clients}
            for child in self.children.values():
                if child.node_id != req.node_id and moved & set(child.clients):
                    child.clients = [c for c in child.clients if c not in moved]
            self.children[req.node_id] = ChildLiveness(req.node_id, req.address, sorted(moved) or
                                                       (old.clients if old is not None else []), None,
                                                       registered_at=self.clock())
        mark_alive = getattr(self.endpoint, "mark_alive", None)
        if mark_alive is not None:
            mark_alive(req.address)
        if old is not None and old.dead:
            self._event("node_returned", req.node_id, f"registered again at {req.address}")
        elif old is not None:   # its earlier process ended (killed and restarted) before it was marked dead
            self._event("node_restarted", req.node_id, f"registered again at {req.address} before it was marked dead")

    # -- heartbeats ------------------------------------------------------------------------
    def beat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        now = self.clock()
        with self._lock:
            child = self.children.get(req.node_id)
            known = child is not None and not child.dead
            if child is not None and known:
                child.last_seen = now
                child.beats += 1
                child.suspected_at = None   # a heartbeat after the failed call: it lives
            else:
                self.stats.unknown_heartbeats += 1
            reply = pb.HeartbeatReply(known=known, node_id=self.endpoint.node_id,
                                      message="" if known else "unknown or dead node: register again")
            self.stats.heartbeats_received += 1
            self.stats.heartbeat_bytes += req.ByteSize() + reply.ByteSize() + 10
        if req.events and known and self.on_events is not None:
            try:
                self.on_events(req.node_id, list(req.events))
            except Exception:
                log.exception("events from %s not taken", req.node_id)
        if req.bytes and self.on_bytes is not None:   # true bytes, whether or not the node is still known
            entries = [e for e in req.bytes if reports_for(req.node_id, e.node_id, self.endpoint.node_id)
                       and counts_fit(e)]
            if len(entries) < len(req.bytes):
                log.warning("%s sent byte totals for nodes it may not speak for, or counts past 2^63 - 1; "
                            "%d of %d entries ignored", req.node_id, len(req.bytes) - len(entries), len(req.bytes))
            try:
                self.on_bytes(entries)
            except Exception:
                log.exception("live byte totals from %s not taken", req.node_id)
        return reply

    # -- detection -------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Mark every child silent for longer than the timeout dead; returns their node ids.

        A gap since the previous check longer than the heartbeat interval plus half the timeout
        means this process itself was not running (SIGSTOP, a VM pause, a swap storm): the
        children's silence is then ours.  Their heartbeats failed meanwhile and are retried with
        backoff, so each child gets the timeout plus as long again as the gap (at most
        MAX_GRACE s) before it can be declared dead."""
        now = self.clock()
        newly: list[ChildLiveness] = []
        with self._lock:
            if self._stop.is_set():   # stopped (`stop`): its children are leaving, not dying
                return []
            gap = now - self._last_check if self._last_check is not None else 0.0
            self._last_check = now
            paused = gap > self.interval + self.timeout / 2
            if paused:
                grace = min(gap, MAX_GRACE)
                for child in self.children.values():
                    if not child.dead and child.last_seen is not None:
                        child.last_seen = max(child.last_seen, now + grace)
                    elif not child.dead:
                        child.registered_at = max(child.registered_at, now + grace)
                    if not child.dead and child.suspected_at is not None:
                        child.suspected_at = max(child.suspected_at, now + grace)
            for child in self.children.values():
                if not child.dead and (now - self._heard(child) > self._allowed(child) or
                                       child.suspected_at is not None and now - child.suspected_at > self.timeout):
                    child.dead, child.dead_since = True, now
                    self.stats.marked_dead += 1
                    self.stats.detection_seconds.append(now - self._heard(child))
                    newly.append(child)
        if paused:
            log.warning("liveness: this process did not run for %.1fs; children get %.1fs before any is "
                        "declared dead", gap, self.timeout + grace)
            self._event("monitor_paused", self.endpoint.node_id,
                        f"no liveness check for {gap:.1f}s (this process was stopped); every child gets "
                        f"{self.timeout + grace:.1f}s (heartbeat timeout + the gap) before it can be declared dead")
        for child in newly:
            silence = now - self._heard(child)
            if child.suspected_at is not None and now - child.suspected_at > self.timeout:
                reason = (f"node {child.node_id} marked dead: no heartbeat in the {now - child.suspected_at:.2f}s "
                          f"since a call to it failed (security.heartbeat_timeout = {self.timeout}s): "
                          f"{child.suspect_reason}")
            elif child.last_seen is None:
                reason = (f"node {child.node_id} marked dead: no heartbeat in the {silence:.2f}s since it registered "
                          f"(set-up grace {SETUP_GRACE:g}s + security.heartbeat_timeout = {self.timeout}s)")
            else:
                reason = (f"node {child.node_id} marked dead: no heartbeat for {silence:.2f}s "
                          f"(security.heartbeat_timeout = {self.timeout}s)")
            cancelled = 0
            mark_dead = getattr(self.endpoint, "mark_dead", None)
            if mark_dead is not None and not self._owned_by_other(child):
                cancelled = mark_dead(child.address, reason)
            log.warning("%s; %d calls in flight cancelled", reason, cancelled)
            self._event("node_dead", child.node_id, f"{reason}; {cancelled} calls in flight cancelled")
        return [c.node_id for c in newly]

    def _owned_by_other(self, child: ChildLiveness) -> bool:
        """Whether a live node other than `child` holds its address (the address is that node's)."""
        with self._lock:
            return any(c.address == child.address and c.node_id != child.node_id and not c.dead
                       for c in self.children.values())

    @staticmethod
    def _heard(child: ChildLiveness) -> float:
        """When the parent last heard from `child`: its last heartbeat, or its registration."""
        return child.last_seen if child.last_seen is not None else child.registered_at

    def _allowed(self, child: ChildLiveness) -> float:
        """How long `child` may stay silent: the heartbeat timeout, plus SETUP_GRACE before its
        first heartbeat (it beats once its set-up after registration is done)."""
        return self.timeout if child.last_seen is not None else self.timeout + SETUP_GRACE

    def dead_nodes(self) -> set[str]:
        """The node ids marked dead."""
        with self._lock:
            return {node_id for node_id, child in self.children.items() if child.dead}

    def suspect(self, node_id: str, reason: str) -> bool:
        """A call to `node_id` failed as a dead process's calls fail (`unreachable`): until its next
        heartbeat it is left out of sampling, and it is marked dead when no heartbeat comes within
        the heartbeat timeout (a process that never beat is judged by its calls, not by the set-up
        grace).  True when it was not suspect (or dead) already."""
        now = self.clock()
        with self._lock:
            child = self.children.get(node_id)
            if child is None or child.dead or child.suspected_at is not None:
                return False
            child.suspected_at, child.suspect_reason = now, reason
        log.warning("%s suspect: %s", node_id, reason)
        return True

    def unavailable_nodes(self) -> set[str]:
        """The node ids marked dead or suspect: sampling leaves their clients out."""
        with self._lock:
            return {node_id for node_id, child in self.children.items()
                    if child.dead or child.suspected_at is not None}

    def is_dead(self, node_id: str) -> bool:
        with self._lock:
            child = self.children.get(node_id)
            return child is not None and child.dead

    def _event(self, kind: str, node: str, detail: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, node, detail)
            except Exception:
                log.exception("liveness event hook failed")

    # -- thread ----------------------------------------------------------------------------
    def start(self) -> "LivenessMonitor":
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"liveness-{self.endpoint.node_id}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """No check after this returns: a check under way finishes first (a parent stopping its
        monitor before it tells its children to leave must not mark them dead as they go)."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout=5.0)
        self._refusals.flush()

    def _run(self) -> None:
        period = min(self.interval, self.timeout / 4)
        while not self._stop.wait(period):
            self.check()

    def summary(self) -> dict:
        s = self.stats
        det = s.detection_seconds
        return {"heartbeat_interval": self.interval, "heartbeat_timeout": self.timeout,
                "heartbeats_received": s.heartbeats_received, "heartbeat_bytes": s.heartbeat_bytes,
                "unknown_heartbeats": s.unknown_heartbeats, "marked_dead": s.marked_dead,
                "reregistrations": s.reregistrations,
                "detection_seconds_max": max(det) if det else None,
                "detection_seconds_mean": sum(det) / len(det) if det else None}


class Without(IndexedView[int]):
    """The ids of `pool` (a range) less the sorted ids `gone` (all in it), in order: the list
    `[c for c in pool if c not in gone]` indexed in O(log len(gone)) and held in O(len(gone))."""

    def __init__(self, pool: range, gone: list[int]) -> None:
        self.pool, self.gone = pool, gone
        # for each gone id, how many kept ids stand before it: the kept index i stands after
        # exactly bisect_right(_before, i) gone ids
        self._before = [pool.index(g) - k for k, g in enumerate(gone)]

    def __len__(self) -> int:
        return len(self.pool) - len(self.gone)

    def _at(self, i: int) -> int:
        return self.pool[i + bisect.bisect_right(self._before, i)]


def _dead_by_node(pool: range, client_home: dict, dead_nodes: set[str], unavailable: AbstractSet[int],
                  hosts: Mapping[str, Sequence[int]], homed: Mapping[str, int]) -> list[int] | None:
    """The clients of `pool` to leave out, sorted, found through the dead nodes' own client lists
    (`hosts`): O(their clients), not O(pool).  None where those lists do not account for every
    client homed at a dead node (`homed`: node id -> how many clients it is the home of)."""
    gone = {c for c in unavailable if c in pool}
    for node_id in dead_nodes:
        mine = [c for c in hosts.get(node_id, ()) if c in client_home and client_home[c].node_id == node_id]
        if len(mine) != homed.get(node_id, 0):
            return None
        gone.update(c for c in mine if c in pool)
    return sorted(gone)


def live_pool(pool: Sequence[int], size: int, client_home: dict, monitor: "LivenessMonitor | None",
              unavailable: AbstractSet[int] = frozenset(), hosts: Mapping[str, Sequence[int]] | None = None,
              homed: Mapping[str, int] | None = None) -> tuple[Sequence[int], list[int]]:
    """The pool a round draws `size` clients from, and the clients left out of it: where fewer
    than the whole pool are drawn, the clients of nodes the monitor marked dead or suspect, and
    the `unavailable` clients (those an edge reported dead), are left out, so no dead client
    takes a live one's place (where every client is sampled, a dead one's call fails fast and is
    recorded as before).  Where every host is dead the pool is kept (the round is then short:
    run.on_short_round).  The draw is a function of the seed, the round and this liveness record
    (the `sampling_excluded` event), so a run is reproducible from its run.db.

    With `hosts` (node id -> its clients) and `homed` (node id -> how many clients it is the home
    of), a `range` pool is narrowed through the dead nodes' clients only, and the pool returned
    is a `Without` view: the same ids in the same order as the list, so the same draw, without a
    walk over every registered client each round."""
    if size >= len(pool):
        return pool, []
    dead_nodes = monitor.unavailable_nodes() if monitor is not None else set()
    if not dead_nodes and not unavailable:   # the usual case: one look, not one per client of the pool
        return pool, []
    if isinstance(pool, range) and hosts is not None and homed is not None:
        by_node = _dead_by_node(pool, client_home, dead_nodes, unavailable, hosts, homed)
        if by_node is not None:
            if not by_node or len(by_node) == len(pool):
                return pool, []
            return Without(pool, by_node), by_node
    dead = [c for c in pool if c in unavailable or c in client_home and client_home[c].node_id in dead_nodes]
    if not dead or len(dead) == len(pool):
        return pool, []
    gone = set(dead)
    return [c for c in pool if c not in gone], dead


def unreachable(why: str) -> bool:
    """Whether a failed call's reason (common/transport/fabric.py `gather`: a CallFailed's text, or
    the round's timeout reason) is how calls to a dead or stopped process fail, as opposed to a
    refused credential or a reply the peer sent (a live process)."""
    if why.startswith("timeout"):
        return True
    if not why.startswith("call to ") or " failed (" not in why:
        return False
    code = why.split(" failed (", 1)[1].split(")", 1)[0]
    return code not in FATAL_CODES
