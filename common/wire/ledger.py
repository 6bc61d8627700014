"""The communication ledger (DESIGN.md section 5).

Every message is recorded twice: once by the process that sent it (`role="sender"`) and once by
the process that received it (`role="receiver"`); both records carry the message's `msg_id`, so
the run store can count each message once and check that the two sides agree.

A process keeps its records in memory (to ship them to its parent, see `Ledger.drain`) and,
optionally, appends them to a JSONL file, one JSON object per line, flushed per record: a
process killed with SIGKILL leaves a readable file whose last line at worst is torn, and
`read_jsonl` skips such a line with a warning.
"""
from __future__ import annotations

import json
import math
import os
import stat
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, cast

# "client-client" is an extension of DESIGN.md section 5: the chain topology (sequential FL across
# clients) passes the model from client to client, and no other link name describes that hop.
LINKS: tuple[str, ...] = ("client-server", "client-edge", "edge-server", "edge-edge", "control", "client-client")
DIRECTIONS: tuple[str, ...] = ("up", "down", "peer", "control")
ROLES: tuple[str, ...] = ("sender", "receiver")
STATUSES: tuple[str, ...] = ("ok", "rejected", "lost")
NODE_ROLES: tuple[str, ...] = ("client", "edge", "server")
BYTE_FIELDS: tuple[str, ...] = ("tensor_bytes", "payload_bytes", "framed_bytes")

_LINK_SET, _DIRECTION_SET, _ROLE_SET, _STATUS_SET = map(frozenset, (LINKS, DIRECTIONS, ROLES, STATUSES))

_LINK_BY_PAIR = {
    frozenset(("client", "server")): "client-server",
    frozenset(("client", "edge")): "client-edge",
    frozenset(("edge", "server")): "edge-server",
    frozenset(("edge",)): "edge-edge",
    frozenset(("client",)): "client-client",
}


def link_for(src_role: str, dst_role: str) -> str:
    """The link name for a message between two node roles; symmetric (server-client = client-server)."""
    for name, role in (("src_role", src_role), ("dst_role", dst_role)):
        if role not in NODE_ROLES:
            raise ValueError(f"link_for: {name}={role!r} is not a node role; allowed: {', '.join(NODE_ROLES)}")
    link = _LINK_BY_PAIR.get(frozenset((src_role, dst_role)))
    if link is None:  # server-server: a process talking to itself, only control traffic
        raise ValueError(f"link_for: no link between {src_role!r} and {dst_role!r}; links: {', '.join(LINKS)}")
    return link


@dataclass
class LedgerRecord:
    """One side's record of one message (DESIGN.md section 5)."""

    run_id: str
    round: int
    step: int
    src: str
    dst: str
    link: str
    direction: str
    method: str
    tensor_bytes: int
    payload_bytes: int
    framed_bytes: int
    seconds: float
    recorder: str
    role: str
    msg_id: str
    status: str
    wall_time: float
    error: str = ""

    def __post_init__(self) -> None:
        if (self.link in _LINK_SET and self.direction in _DIRECTION_SET and self.role in _ROLE_SET
                and self.status in _STATUS_SET and self.tensor_bytes >= 0 and self.payload_bytes >= 0
                and self.framed_bytes >= 0):
            return   # the common case in one test; the loops below name what is wrong
        for name, allowed in (("link", LINKS), ("direction", DIRECTIONS), ("role", ROLES), ("status", STATUSES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"ledger record: {name}={value!r} is not allowed; allowed: {', '.join(allowed)}")
        for name in BYTE_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"ledger record: {name}={getattr(self, name)!r} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        # the fields are flat values: a plain read, not dataclasses.asdict's recursive deep copy
        # (this runs for every message on every process)
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LedgerRecord":
        """Build a record from a dict; unknown keys are ignored, missing required keys are an error."""
        if not isinstance(data, dict):   # a JSON line that is a list, a number, a string
            raise ValueError(f"a JSON {type(data).__name__}, not an object of a record's fields")
        kwargs: dict[str, Any] = {}
        missing = []
        for name, coerce, required in _FROM_DICT:
            value = data.get(name)
            if value is not None:
                kwargs[name] = coerce(value)
            elif required:
                missing.append(name)
        if missing:
            raise ValueError(f"ledger record: missing field(s) {', '.join(missing)}")
        return cls(**kwargs)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(LedgerRecord))
_FIELD_SET = frozenset(_FIELD_NAMES)
#: one JSON line per record, compact (an encoder made once: `json.dumps` with separators makes one per call)
_LINE = json.JSONEncoder(separators=(",", ":"))
#: a str as a JSON string, ASCII only with escapes (what `_LINE` writes for one: ensure_ascii)
_q = json.encoder.encode_basestring_ascii   # the json module's own (C where built)
# a field's type is its annotation's text here (`from __future__ import annotations`)
_COERCE = {f.name: {"int": int, "float": float, "str": str}[cast(str, f.type)] for f in fields(LedgerRecord)}
#: (name, its type's coercion, required) of each field, in order (`LedgerRecord.from_dict`)
_FROM_DICT: tuple[tuple[str, Callable[[Any], Any], bool], ...] = tuple(
    (f.name, _COERCE[f.name], f.default is MISSING and f.default_factory is MISSING) for f in fields(LedgerRecord))


def _number(x: float) -> str:
    """A float as the json module writes it (NaN and the infinities as JavaScript names them)."""
    if math.isfinite(x):
        return float.__repr__(x)
    return "NaN" if x != x else "Infinity" if x > 0 else "-Infinity"


#: the fields `json_line` writes, in order: a record with others takes json's way
_FAST_LINE = _FIELD_NAMES == ("run_id", "round", "step", "src", "dst", "link", "direction", "method", "tensor_bytes",
                              "payload_bytes", "framed_bytes", "seconds", "recorder", "role", "msg_id", "status",
                              "wall_time", "error")


def json_line(r: LedgerRecord) -> str:
    """The record as one compact JSON object, the text `_LINE.encode(r.to_dict())` makes, a few
    times faster (every message is recorded on both of its ends).  Fields of other types than
    their annotations (an int given as a float, a bool, a numpy number) take json's own way."""
    if (_FAST_LINE and type(r.round) is int and type(r.step) is int and type(r.tensor_bytes) is int
            and type(r.payload_bytes) is int and type(r.framed_bytes) is int
            and type(r.seconds) is float and type(r.wall_time) is float):
        try:
            return (f'{{"run_id":{_q(r.run_id)},"round":{r.round},"step":{r.step},"src":{_q(r.src)},'
                    f'"dst":{_q(r.dst)},"link":{_q(r.link)},"direction":{_q(r.direction)},"method":{_q(r.method)},'
                    f'"tensor_bytes":{r.tensor_bytes},"payload_bytes":{r.payload_bytes},'
                    f'"framed_bytes":{r.framed_bytes},"seconds":{_number(r.seconds)},"recorder":{_q(r.recorder)},'
                    f'"role":{_q(r.role)},"msg_id":{_q(r.msg_id)},"status":{_q(r.status)},'
                    f'"wall_time":{_number(r.wall_time)},"error":{_q(r.error)}}}')
        except TypeError:   # a text field that is not a str
            pass
    return _LINE.encode(r.to_dict())


class Ledger:
    """Thread-safe in-memory list of records plus an optional append-only JSONL sink.

    `keep_drained=False` drops records from memory once `drain` has handed them out, for a
    long-running process that ships its records to its parent and must not grow without bound
    (`records()` then returns only the records not yet drained).  `hold=False` keeps none in
    memory: each goes to the sink and the observers only (a client or edge process, whose
    parent merges its file; held, its records would grow by two a message for the whole run),
    and `records()` and `drain()` return nothing.
    """

    def __init__(self, path: str | os.PathLike | None = None, keep_drained: bool = True, hold: bool = True) -> None:
        self._lock = threading.Lock()
        self._records: list[LedgerRecord] = []
        self._drained = 0  # index into _records of the first record not yet drained
        self._keep_drained = keep_drained
        self._hold = hold
        self._deferring = threading.local()   # `deferred`: this thread's lines not yet written
        self.observers: list[Callable[[LedgerRecord], None]] = []   # see each record as it is added (common/transport/livebytes.py)
        self.path = Path(path) if path is not None else None
        self._sink = None
        #: where this ledger's own records begin in its file: the bytes before are a predecessor's
        #: (a process of the same node that ran before, e.g. a server before a resume)
        self.own_from = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn_tail = self.path.exists() and self.path.stat().st_size > 0 and _last_byte(self.path) != b"\n"
            self._sink = open(self.path, "a", encoding="utf-8")
            if torn_tail:  # a killed predecessor left a torn line: end it so our first record stays whole
                self._sink.write("\n")
                self._sink.flush()
            self.own_from = self._sink.tell()

    def record(self, **fields_: Any) -> LedgerRecord:
        """Record one message; `wall_time` defaults to now. Returns the stored record."""
        if not _FIELD_SET.issuperset(fields_):
            unknown = sorted(set(fields_) - _FIELD_SET)
            raise TypeError(f"Ledger.record: unknown field(s) {', '.join(unknown)}; fields: {', '.join(_FIELD_NAMES)}")
        fields_.setdefault("wall_time", time.time())
        rec = LedgerRecord(**fields_)
        self.add(rec)
        return rec

    def add(self, record: LedgerRecord) -> None:
        """Append an existing record (e.g. one shipped up from a child process).

        The record is appended without the lock (a list's `append` is one step under the GIL, and
        `drain` removes a prefix in place): a process whose threads each receive a batch's replies
        records from all of them at once, and a contended lock per record costs each thread a
        wait and a hand-off of the GIL (docs/performance.md, "A reply bundle's records")."""
        line = json_line(record) + "\n" if self._sink is not None else ""
        if self._hold:
            self._records.append(record)
        if self._sink is not None:
            held = getattr(self._deferring, "lines", None)
            if held is not None:
                held.append(line)
            else:
                with self._lock:
                    if self._sink is not None:
                        self._sink.write(line)
                        self._sink.flush()
        for observe in self.observers:
            observe(record)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """The file lines of the records this thread adds inside are written in one write when it
        ends (the records themselves are held and observed at once, as always).  For the replies
        of one reply bundle, which a caller receives together, or of one in-process batch
        (transports/inmemory/endpoint.py `call_many`): one system call for all their records
        instead of one a record.  A record made inside is lost with the process if it
        dies before the end; a callee does not defer, so a request's receipt (written once its
        handler returns) is in the file before its reply goes.  Nested, the outermost writes."""
        if getattr(self._deferring, "lines", None) is not None:
            yield
            return
        lines: list[str] = []
        self._deferring.lines = lines
        try:
            yield
        finally:
            self._deferring.lines = None
            if lines:
                with self._lock:
                    if self._sink is not None:
                        self._sink.write("".join(lines))
                        self._sink.flush()

    def extend(self, records: Iterable[LedgerRecord]) -> None:
        for rec in records:
            self.add(rec)

    def records(self) -> list[LedgerRecord]:
        """A copy of the records held in memory."""
        with self._lock:
            return list(self._records)

    def drain(self) -> list[LedgerRecord]:
        """The records not yet drained, marked drained (what to ship to the parent next)."""
        with self._lock:   # one drain at a time; `add` appends meanwhile, after the prefix taken
            taken = len(self._records)
            out = self._records[self._drained:taken]
            if self._keep_drained:
                self._drained = taken
            else:
                del self._records[:taken]   # in place: an `add` holds no stale list
                self._drained = 0
            return out

    def close(self) -> None:
        with self._lock:
            if self._sink is not None:
                self._sink.close()
                self._sink = None

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def read_jsonl(path: str | os.PathLike) -> list[LedgerRecord]:
        return read_jsonl(path)


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1)


MAX_LINE_BYTES = 1 << 20   # a record is a few hundred bytes; a longer line is skipped unread
_SQLITE_INT = (1 << 63) - 1   # the largest integer a run.db column holds
# warnings per file: each distinct warning stays in the warnings registry and on stderr, so a
# crafted file of millions of bad lines gets this many and then one count
MAX_WARNINGS = 20


def bounded_lines(fh: Any, limit: int = MAX_LINE_BYTES, chunk: int = 1 << 16) -> Iterable[tuple[int, bytes | None]]:
    """(line number, line) of a binary file, read `chunk` bytes at a time; a line longer than
    `limit` bytes is skipped as it streams past (None in its place), so a crafted file of one
    huge line never sits in memory."""
    buf, lineno, over = b"", 0, False
    while True:
        block = fh.read(chunk)
        if not block:
            break
        start = 0
        while True:
            nl = block.find(b"\n", start)
            if nl < 0:
                if not over:
                    buf += block[start:]
                    if len(buf) > limit:
                        buf, over = b"", True
                break
            lineno += 1
            if over or len(buf) + nl - start > limit:
                yield lineno, None
            else:
                yield lineno, buf + block[start:nl]
            buf, over, start = b"", False, nl + 1
    if buf or over:
        yield lineno + 1, None if over else buf


class NotARegularFile(ValueError):
    """A ledger path that is no regular file (a FIFO, a device such as /dev/zero, a directory):
    reading one could block forever or never end, so it is refused unread."""


def open_regular(path: str | os.PathLike) -> Any:
    """`path` opened for binary reading, or `NotARegularFile`.  The file is opened without
    blocking (a FIFO with no writer would otherwise hang the open itself) and checked with fstat
    on the open descriptor, so a path swapped for a FIFO after a check is still caught."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "not a regular file")
            raise NotARegularFile(f"{path}: {kind}, not a regular ledger file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _Prefix:
    """A binary file's first `stop` bytes, read as `bounded_lines` reads a file."""

    def __init__(self, fh: Any, stop: int) -> None:
        self.fh, self.left = fh, max(stop, 0)

    def read(self, n: int) -> bytes:
        block = self.fh.read(min(n, self.left)) if self.left else b""
        self.left -= len(block)
        return block


#: the fields a run.db integer column holds (checked against its range as a file is read)
_INT_FIELDS = tuple(name for name, kind in _COERCE.items() if kind is int)


def iter_jsonl(path: str | os.PathLike, stop: int | None = None) -> Iterator[LedgerRecord]:
    """Records from a ledger JSONL file, one at a time: memory stays at one 64 KiB block and one
    line however large the file.  Unreadable lines (a torn last line, a line over
    MAX_LINE_BYTES, JSON nested too deeply, a count beyond 2^63 - 1) are skipped with a warning;
    a path that is no regular file raises `NotARegularFile` before anything is read.  `stop`:
    only the file's bytes before this offset are read."""
    skipped = 0

    def skip(lineno: int, why: str) -> None:
        nonlocal skipped
        skipped += 1
        if skipped <= MAX_WARNINGS:
            warnings.warn(f"{path}:{lineno}: skipping {why}", stacklevel=3)

    with open_regular(path) as fh:
        for lineno, raw in bounded_lines(fh if stop is None else _Prefix(fh, stop)):
            if raw is None:
                skip(lineno, f"a ledger line over {MAX_LINE_BYTES} bytes")
                continue
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                record = LedgerRecord.from_dict(json.loads(line))
                if any(abs(getattr(record, k)) > _SQLITE_INT for k in _INT_FIELDS):
                    raise ValueError("a count beyond 2^63 - 1")
            except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
                # JSONDecodeError is a ValueError; RecursionError: JSON nested too deeply
                skip(lineno, f"unreadable ledger line ({str(exc)[:200]})")
                continue
            yield record
    if skipped > MAX_WARNINGS:
        warnings.warn(f"{path}: {skipped - MAX_WARNINGS} more unreadable ledger lines skipped", stacklevel=2)


def iter_jsonl_batches(path: str | os.PathLike, size: int = 10_000, stop: int | None = None) -> Iterator[list[LedgerRecord]]:
    """`iter_jsonl` in lists of at most `size` records (what a merge inserts per transaction)."""
    batch: list[LedgerRecord] = []
    for record in iter_jsonl(path, stop):
        batch.append(record)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def read_jsonl(path: str | os.PathLike) -> list[LedgerRecord]:
    """Every record of a ledger JSONL file (`iter_jsonl`) in a list: for a process's own ledger;
    a file of unknown size is merged batch by batch (`iter_jsonl_batches`)."""
    return list(iter_jsonl(path))


def count_once(records: Iterable[LedgerRecord]) -> list[LedgerRecord]:
    """One record per message: the sender's, or the receiver's where the sender's is missing."""
    chosen: dict[str, LedgerRecord] = {}
    for rec in records:
        have = chosen.get(rec.msg_id)
        if have is None or (have.role == "receiver" and rec.role == "sender"):
            chosen[rec.msg_id] = rec
    return list(chosen.values())


def bytes_by_link(records: Iterable[LedgerRecord]) -> dict[str, dict[str, int]]:
    """In-memory twin of `RunStore.bytes_by_link`: totals per link plus "total", each message once."""
    out: dict[str, dict[str, int]] = {}
    total = {k: 0 for k in (*BYTE_FIELDS, "messages")}
    for rec in count_once(records):
        row = out.setdefault(rec.link, {k: 0 for k in (*BYTE_FIELDS, "messages")})
        for k in BYTE_FIELDS:
            row[k] += getattr(rec, k)
            total[k] += getattr(rec, k)
        row["messages"] += 1
        total["messages"] += 1
    out["total"] = total
    return out

