"""Admission: who may register, and how refusals are reported without letting a flood of
them become a flood of run.db rows and log lines (issue 17, item 3).

- `takeover_refusal`: a node id that a live child holds cannot be registered again from
  another address; the old process must first be marked dead by the liveness monitor
  (common/liveness.py), after which the new one registers normally.  (Re-registering from the
  same address, e.g. a retried registration whose reply was lost, moves nothing.)
- `EventThrottle`: at most one event per (kind, peer) per interval; refusals inside the
  interval are counted and the count is carried by the next event for that peer (or by
  `flush`).  Peers are keyed by host, not host:port, so reconnecting does not reset the count;
  the number of peers remembered is bounded.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

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
