"""An edge's refusals, reported to the server's run.db (docs/faults.md, "Refusals at edges").

An edge refuses registrations (wrong token, a node id or address a live child holds, clients
outside its cluster), calls that fail authentication, and calls over a caller's share of its
call slots.  They are aggregated as the server aggregates its own (`EventThrottle`: one event per
kind and peer per interval, carrying the count of those folded in) and queued here; each
heartbeat to the server carries the queue (`HeartbeatRequest.events`), and the server records
every entry as an event of the same kind, its detail prefixed with the edge's node id.  The
queue is bounded: past `MAX_QUEUED` entries one more is counted, not kept, and the count is sent
as one `events_dropped` entry.
"""
from __future__ import annotations

import threading

from fedhop.common.transport.admission import EDGE_EVENT_KINDS as REPORTED_KINDS
from fedhop.common.transport.admission import EventThrottle, peer_host
from fedhop.common.wire import fedhop_pb2 as pb

MAX_QUEUED = 256


class EventOutbox:
    """Events waiting for the next heartbeat (bounded, thread-safe)."""

    def __init__(self, limit: int = MAX_QUEUED) -> None:
        self.limit = limit
        self._items: list[pb.NodeEvent] = []
        self._dropped = 0
        self._lock = threading.Lock()

    def add(self, kind: str, node: str, detail: str) -> None:
        with self._lock:
            if len(self._items) >= self.limit:
                self._dropped += 1
            else:
                self._items.append(pb.NodeEvent(kind=kind, node=node, detail=detail))

    def take(self) -> list[pb.NodeEvent]:
        """Everything queued (emptied): what one heartbeat carries."""
        with self._lock:
            items, self._items = self._items, []
            dropped, self._dropped = self._dropped, 0
        if dropped:
            items.append(pb.NodeEvent(kind="events_dropped", node="", detail=f"{dropped} more refusal events "
                                                                              f"over the queue's {self.limit}"))
        return items


class EdgeRefusals:
    """The hooks an edge's endpoint and liveness monitor call on a refusal."""

    def __init__(self, outbox: EventOutbox, interval: float = 10.0) -> None:
        self.outbox = outbox
        self.throttle = EventThrottle(outbox.add, interval=interval)

    def monitor_event(self, kind: str, node: str, detail: str) -> None:
        """The liveness monitor's events (already throttled per node): the refusals are queued."""
        if kind in REPORTED_KINDS:
            self.outbox.add(kind, node, detail)

    def auth_refused(self, node: str, method: str, reason: str, peer: str) -> None:
        self.throttle("auth_refused", peer_host(peer), node or "?", f"{method} from {peer}: {reason}")

    def call_refused(self, node: str, method: str, reason: str, peer: str) -> None:
        self.throttle("call_refused", node or peer_host(peer), node or "?", f"{method} from {peer}: {reason}")

    def flush(self) -> None:
        """The refusals folded since each peer's last event, queued now (before the last heartbeat)."""
        self.throttle.flush()
