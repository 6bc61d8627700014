"""Live byte accounting: every link's bytes at the server while a run is live (issue 18, item 2).

The final table counts each message once, from run.db after every process's ledger has been
merged.  While the run is live the server holds only its own records, so each process keeps
running totals of its own ledger and sends them up with its heartbeats; an edge relays the
totals its children last sent it.  To count each message exactly once without message ids,
each message is counted by one of its two ends:

- a message between a parent and its child is counted by the parent (it records every one of
  them, the child's shutdown reply included, and the server is every top-level child's parent);
- a message between peers (edge to edge, client to client) is counted by its sender.

So the server's view is exact for every message it took part in as soon as it is recorded, and
exact for the rest as of each process's latest heartbeat; when the run ends each child sends a
last heartbeat before it answers `shutdown` (common/transport/liveness.py), and the live totals equal the
final table.
"""
from __future__ import annotations

import threading
from typing import Iterable, Sequence

from fedhop.common.transport.base import role_of
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import BYTE_FIELDS, LedgerRecord

TIERS = {"server": 0, "edge": 1, "client": 2}
FIELDS: tuple[str, ...] = ("messages", *BYTE_FIELDS)
MAX_COUNT = (1 << 63) - 1   # what run.db's INTEGER columns hold (the wire's counts are uint64)


def counts_fit(entry: pb.LinkBytes) -> bool:
    """Whether a reported entry's counts fit run.db (a count past 2^63 - 1 is no real count)."""
    return all(int(getattr(entry, f)) <= MAX_COUNT for f in FIELDS)
Key = tuple[str, str]   # (link, direction)


def counted_by(record: LedgerRecord, tier: int) -> bool:
    """Whether the process at `tier` (0 server, 1 edge, 2 client) that recorded `record` counts
    it in the live view (module docstring)."""
    other = record.dst if record.role == "sender" else record.src
    other_tier = TIERS.get(role_of(other))
    if other_tier is None or other_tier == tier:   # a peer (or an unnamed one): its sender counts it
        return record.role == "sender"
    return other_tier > tier                       # a child's message: counted here; a parent's: there


EARLIER = " (earlier attempts)"   # suffix of a node's live rows carried over into a resumed run


def counting_node(src: str, dst: str) -> str:
    """The end of a message between `src` and `dst` that counts it in the live view (module
    docstring): the parent of a parent-child message, the sender of a message between peers."""
    a, b = TIERS.get(role_of(src)), TIERS.get(role_of(dst))
    if a is None or b is None or a == b:
        return src
    return src if a < b else dst


def carried_rows(once: Iterable[tuple]) -> list[tuple]:
    """A resumed run's live view starts from its earlier attempts' messages: `once` holds (src, dst,
    link, direction, messages, tensor_bytes, payload_bytes, framed_bytes) totals of every message
    run.db holds, each counted once (the final table's rule); each total goes to the node that
    counts it, under that node's name + EARLIER, so the new attempt's reports (which replace a
    node's own rows) sit beside it and the live totals count the whole run."""
    acc: dict[tuple[str, str, str], list[int]] = {}
    for src, dst, link, direction, *sums in once:
        row = acc.setdefault((counting_node(src, dst) + EARLIER, link, direction), [0] * len(FIELDS))
        for i, v in enumerate(sums):
            row[i] += int(v or 0)
    return [(*key, *row) for key, row in sorted(acc.items())]


class LinkCounter:
    """One process's live totals over its own ledger records (a `Ledger` observer)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.tier = TIERS.get(role_of(node_id), 2)
        self._totals: dict[Key, list[int]] = {}
        self._lock = threading.Lock()

    def observe(self, record: LedgerRecord) -> None:
        if record.recorder != self.node_id or not counted_by(record, self.tier):
            return
        with self._lock:
            row = self._totals.setdefault((record.link, record.direction), [0] * len(FIELDS))
            row[0] += 1
            for i, name in enumerate(BYTE_FIELDS, start=1):
                row[i] += int(getattr(record, name))

    def entries(self) -> list[pb.LinkBytes]:
        with self._lock:
            return [pb.LinkBytes(node_id=self.node_id, link=link, direction=direction,
                                 **dict(zip(FIELDS, row))) for (link, direction), row in sorted(self._totals.items())]

    def take(self) -> list[list[str | int]]:
        """The totals counted since the last `take`, as rows [link, direction, *FIELDS], and
        the counter zeroed: how an in-process engine's worker hands its process's counts to the
        engine with each reply (deploy/launch/workers.py), a few numbers instead of its records."""
        with self._lock:
            taken: list[list[str | int]] = [[link, direction, *row] for (link, direction), row in self._totals.items()]
            self._totals = {}
        return taken

    def add(self, taken: Iterable[Sequence[str | int]]) -> None:
        """Add another counter's `take` for the same process; ValueError on a row that is not
        [link, direction, *FIELDS]."""
        checked: list[tuple[Key, list[int]]] = []
        for row in taken:
            if len(row) != 2 + len(FIELDS) or not all(isinstance(v, str) for v in row[:2]) \
                    or not all(isinstance(v, int) and v >= 0 for v in row[2:]):
                raise ValueError(f"a byte count row that is not [link, direction, {', '.join(FIELDS)}]: {row!r}")
            checked.append(((str(row[0]), str(row[1])), [int(v) for v in row[2:]]))
        with self._lock:
            for key, values in checked:
                totals = self._totals.setdefault(key, [0] * len(FIELDS))
                for i, v in enumerate(values):
                    totals[i] += v


class Reported:
    """The latest totals each descendant reported (an edge relays them; the server stores them).
    Totals are cumulative, so a node's newer report replaces its older one."""

    def __init__(self) -> None:
        self._by_node: dict[str, list[pb.LinkBytes]] = {}
        self._lock = threading.Lock()

    def report(self, entries: Iterable[pb.LinkBytes]) -> list[str]:
        """Take a heartbeat's entries; returns the node ids they were about."""
        fresh: dict[str, list[pb.LinkBytes]] = {}
        for e in entries:
            fresh.setdefault(e.node_id, []).append(e)
        with self._lock:
            self._by_node.update(fresh)
        return list(fresh)

    def entries(self, nodes: Iterable[str] | None = None) -> list[pb.LinkBytes]:
        with self._lock:
            chosen = self._by_node if nodes is None else {n: self._by_node.get(n, []) for n in nodes}
            return [e for node in sorted(chosen) for e in chosen[node]]


def rows(entries: Iterable[pb.LinkBytes]) -> list[tuple]:
    """(node_id, link, direction, messages, tensor_bytes, payload_bytes, framed_bytes) tuples."""
    return [(e.node_id, e.link, e.direction, *(int(getattr(e, f)) for f in FIELDS)) for e in entries]


class ServerLive:
    """The server's live view: its own counter plus every descendant's latest report, kept in
    run.db's `live_bytes` table so the launcher's progress line and `fedhop dashboard` read it."""

    def __init__(self, store, counter: LinkCounter) -> None:
        self.store = store
        self.counter = counter
        self.reported = Reported()

    def report(self, entries: Iterable[pb.LinkBytes]) -> None:
        entries = list(entries)
        nodes = self.reported.report(entries)
        self.store.set_live_bytes(nodes, rows(entries))

    def flush(self, round: int | None = None) -> None:
        """Store the server's own totals (after each round, noting the live total in its row, and
        once the run has ended)."""
        self.store.set_live_bytes([self.counter.node_id], rows(self.counter.entries()), round)
