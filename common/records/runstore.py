"""The run store: one SQLite file, `run.db`, per run directory (DESIGN.md section 6).

Tables: `runs` (one row per run), `rounds` (one row per round, metrics as JSON), `messages`
(every ledger record, both sides of each message) and `events` (failures, rejections, timeouts,
hand-offs, skips).  `messages` has UNIQUE(msg_id, role), so inserting the same records again --
a resumed run, a re-merge of a child's JSONL ledger -- changes nothing.

Byte totals count each message once: the sender's record, or the receiver's where the sender's
is missing (a sender killed before its ledger reached the server).  A run.db holds one run (a
resumed run keeps its run_id), so the read methods do not filter by run_id.

One connection, guarded by a lock, serves every thread; WAL mode lets a reader (`fedhop report`
on a live run) read while the server writes.  A WAL is removed only by the last connection to
close, and a read-only one cannot remove it: where a reader (the launcher's progress, a
dashboard) is open at the moment the store closes, the WAL stays beside run.db.  So `close`
first checkpoints every transaction into run.db (nothing is then only in the WAL: a copy of
run.db alone, or an `immutable` read, holds the whole run), and walfold.py's `fold_wal` removes
what is left once none of the run's processes is running (the launcher after a run, a folder's
next user).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import sqlite3
import threading
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, cast

from fedhop.common.records.walfold import CLOSE_CHECKPOINT_WAIT, connect_ro
from fedhop.common.transport.livebytes import carried_rows
from fedhop.common.wire.ledger import BYTE_FIELDS, LedgerRecord, iter_jsonl_batches

_MESSAGE_COLUMNS: tuple[str, ...] = tuple(LedgerRecord.__dataclass_fields__)
#: a record's messages row, its fields in column order
_MESSAGE_ROW = operator.attrgetter(*_MESSAGE_COLUMNS)
_SQL_TYPE = {"int": "INTEGER", "float": "REAL", "str": "TEXT"}

#: run.db's schema version (SQLite's user_version).  1: `rounds` held participants, sampled and
#: failures as JSON text (so `participants < 5` compared strings); 2: counts in INTEGER columns,
#: lists (where a caller gave lists) in *_json columns, the live_bytes table, and each round's
#: live_framed_bytes (every link's framed bytes in the live view when the round was recorded).
SCHEMA_VERSION = 2
_COUNT_COLUMNS = ("participants", "sampled", "failures")
_ROUNDS_TABLE = """CREATE TABLE IF NOT EXISTS {name}(
        run_id TEXT NOT NULL, round INTEGER NOT NULL, participants INTEGER, sampled INTEGER, failures INTEGER,
        participants_json TEXT, sampled_json TEXT, failures_json TEXT, live_framed_bytes INTEGER,
        metrics_json TEXT, wall_seconds REAL, sim_seconds REAL, started REAL, finished REAL,
        PRIMARY KEY(run_id, round))"""

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS runs(
        run_id TEXT PRIMARY KEY, name TEXT, algorithm TEXT, topology TEXT, transport TEXT,
        config_toml TEXT, started REAL, finished REAL, status TEXT)""",
    _ROUNDS_TABLE.format(name="rounds"),
    "CREATE TABLE IF NOT EXISTS messages(" + ", ".join(
        f"{name} {_SQL_TYPE[cast(str, f.type)]}{' NOT NULL' if name == 'msg_id' else ''}"
        for name, f in LedgerRecord.__dataclass_fields__.items()) + ", UNIQUE(msg_id, role))",
    "CREATE INDEX IF NOT EXISTS messages_round ON messages(round)",
    """CREATE TABLE IF NOT EXISTS events(
        id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT, round INTEGER, time REAL, kind TEXT NOT NULL,
        node TEXT, detail TEXT)""",
    "CREATE INDEX IF NOT EXISTS events_kind ON events(kind)",
    # every process's live byte totals, as its heartbeats last reported them (common/transport/livebytes.py)
    """CREATE TABLE IF NOT EXISTS live_bytes(
        node TEXT NOT NULL, link TEXT NOT NULL, direction TEXT NOT NULL, messages INTEGER, tensor_bytes INTEGER,
        payload_bytes INTEGER, framed_bytes INTEGER, updated REAL, PRIMARY KEY(node, link, direction))""",
]

# Columns added after the first schema: (table, column, type), added to older databases on open.
_ADDED_COLUMNS = [("rounds", "clients_dropped", "INTEGER")]


#: what every schema version's tables hold: a table of one of these names without them is no run's
_KEY_COLUMNS = {"runs": ("run_id", "status"), "rounds": ("run_id", "round"),
                "messages": ("run_id", "round", "msg_id", "role", "framed_bytes"), "events": ("kind", "detail")}


def foreign_schema_problem(path: str | os.PathLike) -> str | None:
    """Why the SQLite file at `path` is not a fedhop run.db a writer may open (opening one brings
    its schema up to date, which would change a file that is someone else's), or None.  Read-only:
    the file is not changed, and no -wal or -shm file is left beside it."""
    try:
        conn = connect_ro(Path(path), timeout=5.0)
    except (sqlite3.Error, FileNotFoundError) as exc:
        return f"not a SQLite database ({exc})"
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and not tables & set(_KEY_COLUMNS):
            return f"holds no table of a run (tables: {', '.join(sorted(tables)[:5])})"
        for table, needed in _KEY_COLUMNS.items():
            if table in tables:
                have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
                missing = [c for c in needed if c not in have]
                if missing:
                    return f"its table {table} is not a run's (no column {missing[0]})"
    except sqlite3.Error as exc:
        return f"not a SQLite database ({exc})"
    finally:
        conn.close()
    return None


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    for table, column, sql_type in _ADDED_COLUMNS:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}")


# Each message once: every sender record, plus receiver records whose sender record is missing.
_ONCE = """WITH once AS (
    SELECT * FROM messages WHERE role = 'sender'
    UNION ALL
    SELECT * FROM messages AS r WHERE r.role = 'receiver' AND NOT EXISTS (
        SELECT 1 FROM messages AS s WHERE s.msg_id = r.msg_id AND s.role = 'sender'))
"""
#: nodes named in one `IN (...)` list (SQLite allows 32,766 bound values from 3.32; older builds 999)
_IN_CHUNK = 400
_SUMS = "SUM(tensor_bytes), SUM(payload_bytes), SUM(framed_bytes), COUNT(*)"
_SUMS_LIVE = "COUNT(*), SUM(tensor_bytes), SUM(payload_bytes), SUM(framed_bytes)"   # live_bytes' column order
_AGREE_FIELDS: tuple[str, ...] = ("tensor_bytes", "payload_bytes", "framed_bytes", "src", "dst", "link")


def _totals(row: Iterable[Any]) -> dict[str, int]:
    vals = list(row)
    return {k: int(v or 0) for k, v in zip((*BYTE_FIELDS, "messages"), vals)}


def _zero() -> dict[str, int]:
    return {k: 0 for k in (*BYTE_FIELDS, "messages")}


def _json_default(obj: Any) -> Any:
    """numpy / torch scalars and arrays in metrics or participant lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"run store: cannot store {type(obj).__name__} as JSON")


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=_json_default)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _count_and_list(value: Any) -> tuple[int | None, str | None]:
    """A rounds count column's value: (count, JSON of the list or None)."""
    if value is None:
        return None, None
    if isinstance(value, (list, tuple, set)):
        return len(value), _dumps(sorted(value) if isinstance(value, set) else list(value))
    return int(value), None


def migrate(conn: sqlite3.Connection) -> None:
    """Bring a run.db of an older schema to SCHEMA_VERSION (a no-op on a new or current file)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    has_rounds = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'rounds'").fetchone()
    if version >= SCHEMA_VERSION or not has_rounds:
        return
    columns = [r[1] for r in conn.execute("PRAGMA table_info(rounds)")]
    if "participants_json" in columns:
        return
    conn.execute("BEGIN")
    try:   # schema 1 -> 2: JSON text counts or lists become INTEGER counts (and the lists in *_json)
        conn.execute(_ROUNDS_TABLE.format(name="rounds_v2"))
        old = conn.execute("SELECT run_id, round, participants, sampled, failures, metrics_json, wall_seconds, "
                           "sim_seconds, started, finished FROM rounds").fetchall()
        for run_id, rnd, p, s, f, *rest in old:
            counts = [_count_and_list(_loads(v)) for v in (p, s, f)]
            conn.execute("INSERT INTO rounds_v2 VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?)",
                         (run_id, rnd, *(c for c, _ in counts), *(j for _, j in counts), *rest))
        conn.execute("DROP TABLE rounds")
        conn.execute("ALTER TABLE rounds_v2 RENAME TO rounds")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if one is still open: a signal's exception (Ctrl-C, a
    SIGTERM's `Stopped`) can be raised just after COMMIT finished, and a ROLLBACK then would fail
    with its own error and hide the stop."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


@dataclass
class AgreementReport:
    """Do the sender's and receiver's records of each message agree? (DESIGN.md section 5)

    `lost` lists messages whose sender recorded them as lost (no receiver record is expected);
    they do not make the report fail.
    """

    matched: int = 0
    sender_only: list[str] = field(default_factory=list)
    receiver_only: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    mismatch_fields: dict[str, list[str]] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    ok: bool = True

    def summary(self) -> str:
        head = "sender and receiver records agree" if self.ok else "sender and receiver records DISAGREE"
        parts = [f"{self.matched} matched", f"{len(self.mismatched)} mismatched",
                 f"{len(self.sender_only)} sender-only", f"{len(self.receiver_only)} receiver-only",
                 f"{len(self.lost)} lost"]
        return f"{head}: " + ", ".join(parts)


class RunStore:
    """SQLite run store over `path` (a `run.db` file, or a run directory holding one).

    `create=False` opens an existing file without creating tables (a merge of ledger files into
    it, a read); reads of a table the file lacks return nothing.  `read_only=True` (with
    `create=False`) opens it read-only (walfold.py `connect_ro`): what the report, the dashboard
    and a sweep's objective use, so that reading a run changes nothing in its folder and works
    where the folder cannot be written.
    """

    def __init__(self, path: str | os.PathLike, run_id: str | None = None, create: bool = True,
                 read_only: bool = False) -> None:
        if create and read_only:
            raise ValueError("run store: read_only=True opens an existing file (create=False)")
        p = Path(path)
        if p.is_dir():
            p = p / "run.db"
        if not create and not p.exists():
            raise FileNotFoundError(f"run store: no run database at {p}")
        if create:
            p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p
        self.final = False   # set by finish_run: later events of this run are dropped
        self.writer = create   # a writer's close checkpoints the WAL (`close`)
        self._lock = threading.RLock()
        self._conn = (connect_ro(p, timeout=30.0, check_same_thread=False, isolation_level=None) if read_only else
                      sqlite3.connect(str(p), check_same_thread=False, isolation_level=None, timeout=30.0))
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 30000")
            if create:
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA synchronous = NORMAL")
                migrate(self._conn)
                for stmt in _SCHEMA:
                    self._conn.execute(stmt)
                _add_missing_columns(self._conn)
                self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        self.run_id = run_id if run_id is not None else self._only_run_id()

    # -- plumbing ---------------------------------------------------------------------
    def _only_run_id(self) -> str | None:
        if "runs" not in self._tables:
            return None
        rows = self._query("SELECT run_id FROM runs ORDER BY started DESC LIMIT 1")
        return rows[0][0] if rows else None

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, tuple(params)).fetchall()

    def _dicts(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._conn.execute(sql, tuple(params))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def _exec(self, sql: str, params: Iterable[Any] = ()) -> None:
        with self._lock:
            self._conn.execute(sql, tuple(params))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction for every write made inside it (the writes of this class open their
        own otherwise): a round's ledger rows, its row and the server's live totals commit
        together, so a reader of run.db sees the round whole or not at all.  (A COMMIT's cost is
        the WAL pages it writes, so one instead of three saves little time: docs/performance.md.)
        Holds the store's lock throughout, so keep only run.db writes inside.  Nested: the
        inner block joins the outer transaction."""
        with self._lock:
            if self._conn.in_transaction:
                yield
                return
            self._conn.execute("BEGIN")
            try:
                yield
                self._conn.execute("COMMIT")
            except BaseException:
                rollback(self._conn)
                raise

    def _has(self, table: str) -> bool:
        return table in self._tables

    def _need_run_id(self, run_id: str | None) -> str:
        rid = run_id if run_id is not None else self.run_id
        if rid is None:
            raise ValueError("run store: no run_id; call start_run(run_id=...) first or pass run_id=")
        return rid

    def close(self) -> None:
        """Close; a writer (`create`) first checkpoints the WAL into run.db (module docstring),
        waiting at most CLOSE_CHECKPOINT_WAIT s for a reader of an older snapshot: one that
        holds it longer leaves the rest of the WAL for the last connection or `fold_wal`.  A
        reader (`create=False`) never waits on the writer of a live run."""
        with self._lock:
            if self.writer:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute(f"PRAGMA busy_timeout = {int(CLOSE_CHECKPOINT_WAIT * 1000)}")
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            self._conn.close()

    def __enter__(self) -> "RunStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------
    def start_run(self, run_id: str, name: str = "", algorithm: str = "", topology: str = "",
                  transport: str = "", config_toml: str = "", started: float | None = None) -> None:
        """Create the run's row, or mark an existing one (a resumed run) running again; a resumed
        run's live view then starts from the messages of its earlier attempts (`carry_live_bytes`)."""
        self.run_id = run_id
        self.final = False
        resumed = bool(self._query("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)))
        if resumed:
            self.carry_live_bytes()
        self._exec(
            """INSERT INTO runs(run_id, name, algorithm, topology, transport, config_toml, started, finished, status)
               VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 'running')
               ON CONFLICT(run_id) DO UPDATE SET status = 'running', finished = NULL""",
            (run_id, name, algorithm, topology, transport, config_toml, _time.time() if started is None else started))

    def finish_run(self, status: str, finished: float | None = None, run_id: str | None = None) -> None:
        if not status:
            raise ValueError("run store: finish_run status must be non-empty (e.g. 'completed', 'failed')")
        self._exec("UPDATE runs SET status = ?, finished = ? WHERE run_id = ?",
                   (status, _time.time() if finished is None else finished, self._need_run_id(run_id)))
        self.final = run_id is None or run_id == self.run_id

    def add_round(self, round: int, *, participants: Any = None, sampled: Any = None, failures: Any = None,
                  metrics: dict[str, Any] | None = None, wall_seconds: float | None = None,
                  sim_seconds: float | None = None, started: float | None = None, finished: float | None = None,
                  clients_dropped: int | None = None, run_id: str | None = None) -> None:
        """Store (or, for a re-run round after a resume, replace) one round's row.

        `participants`, `sampled`, `failures` are counts or lists of client ids: the count goes in
        an INTEGER column, a list also in its *_json column.
        `clients_dropped` (INTEGER) counts the sampled clients whose result did not enter the round.
        """
        counts = [_count_and_list(v) for v in (participants, sampled, failures)]
        self._exec(
            """INSERT OR REPLACE INTO rounds(run_id, round, participants, sampled, failures, participants_json,
                                             sampled_json, failures_json, metrics_json,
                                             wall_seconds, sim_seconds, started, finished, clients_dropped)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (self._need_run_id(run_id), int(round), *(c for c, _ in counts), *(j for _, j in counts),
             _dumps(metrics or {}), wall_seconds, sim_seconds, started, finished,
             None if clients_dropped is None else int(clients_dropped)))

    def clients_dropped(self) -> int:
        """Sampled clients dropped over every recorded round (a re-run round counted once)."""
        if not self._has("rounds"):
            return 0
        return int(self._query("SELECT COALESCE(SUM(clients_dropped), 0) FROM rounds")[0][0])

    def set_live_bytes(self, nodes: Iterable[str], rows: Iterable[tuple], round: int | None = None) -> None:
        """Replace the live totals of `nodes` with `rows` of (node, link, direction, messages,
        tensor_bytes, payload_bytes, framed_bytes) (common/transport/livebytes.py); with `round`, also note
        the live framed total in that round's row."""
        nodes, rows = list(nodes), list(rows)
        now = _time.time()
        with self.transaction():
            self._conn.executemany("DELETE FROM live_bytes WHERE node = ?", [(n,) for n in nodes])
            self._conn.executemany("INSERT INTO live_bytes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                   [(*r, now) for r in rows])
            if round is not None:
                self._conn.execute("UPDATE rounds SET live_framed_bytes = (SELECT SUM(framed_bytes) FROM live_bytes) "
                                   "WHERE round = ?", (int(round),))

    def carry_live_bytes(self) -> None:
        """Start a resumed run's live view from every message its earlier attempts left in run.db
        (each counted once, as the final table counts it; common/transport/livebytes.py
        `carried_rows`), dropping those attempts' own live rows: the live totals, the progress line,
        the rounds' live_framed_bytes and the live page then count the whole run, and equal the
        final table when it ends."""
        once = self._query(_ONCE + f"SELECT src, dst, link, direction, {_SUMS_LIVE} FROM once "
                                   "GROUP BY src, dst, link, direction") if self._has("messages") else []
        now = _time.time()
        with self.transaction():
            self._conn.execute("DELETE FROM live_bytes")
            self._conn.executemany("INSERT INTO live_bytes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                   [(*r, now) for r in carried_rows(once)])

    def add_event(self, kind: str, *, node: str = "", detail: Any = "", round: int | None = None,
                  time: float | None = None, run_id: str | None = None) -> None:
        """Record an event (client_failed, rejected_payload, timeout, handoff, skip, ...)."""
        if not kind:
            raise ValueError("run store: event kind must be non-empty")
        if self.final and run_id is None:   # the run's record is final (finish_run): nothing lands after it
            return
        text = detail if isinstance(detail, str) else _dumps(detail)
        self._exec("INSERT INTO events(run_id, round, time, kind, node, detail) VALUES (?, ?, ?, ?, ?, ?)",
                   (run_id if run_id is not None else self.run_id, round,
                    _time.time() if time is None else time, kind, node, text))

    def insert_records(self, records: Iterable[LedgerRecord | dict[str, Any]]) -> int:
        """Insert ledger records; ones already stored (same msg_id and role) are skipped.

        Returns the number of rows actually inserted.  A record without a msg_id gets a stable
        one derived from its content, so inserting it again is still a no-op.
        """
        rows = []
        for rec in records:
            record = rec if isinstance(rec, LedgerRecord) else LedgerRecord.from_dict(rec)
            if record.msg_id:
                rows.append(_MESSAGE_ROW(record))
                continue
            d = record.to_dict()
            digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]
            d["msg_id"] = f"anon-{digest}"
            rows.append(tuple(d[c] for c in _MESSAGE_COLUMNS))
        if not rows:
            return 0
        sql = (f"INSERT OR IGNORE INTO messages({', '.join(_MESSAGE_COLUMNS)}) "
               f"VALUES ({', '.join('?' for _ in _MESSAGE_COLUMNS)})")
        with self.transaction():
            before = self._conn.total_changes
            self._conn.executemany(sql, rows)
            return self._conn.total_changes - before

    def insert_jsonl(self, path: str | os.PathLike, stop: int | None = None) -> int:
        """Merge a process's JSONL ledger file (torn last line skipped with a warning), 10,000
        records a transaction (`iter_jsonl_batches`): the server's memory while it merges stays
        one batch, not the whole file, which grows with the run (two records a message).
        `stop`: only the records in the file's bytes before this offset."""
        return sum(self.insert_records(batch) for batch in iter_jsonl_batches(path, stop=stop))

    def merge_ledger_dir(self, folder: str | os.PathLike, stored: Mapping[Path, int] | None = None) -> int:
        """Merge every process's ledger file in `folder` (a run's ledger/*.jsonl); idempotent.
        `stored`: files whose records from a byte offset on are in run.db already (the server's
        own ledger, drained into run.db round by round): only the bytes before it are read.
        Returns the number of records that were not yet in run.db."""
        stored = {Path(p).resolve(): offset for p, offset in (stored or {}).items()}
        return sum(self.insert_jsonl(path, stored.get(path.resolve()))
                   for path in sorted(Path(folder).glob("*.jsonl")))

    # -- reading ----------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        """The run's row (the one named by run_id, else the latest started)."""
        if not self._has("runs"):
            return None
        if self.run_id is not None:
            rows = self._dicts("SELECT * FROM runs WHERE run_id = ?", (self.run_id,))
        else:
            rows = self._dicts("SELECT * FROM runs ORDER BY started DESC LIMIT 1")
        return rows[0] if rows else None

    def rounds(self) -> list[dict[str, Any]]:
        """Round rows in round order; JSON columns decoded, metrics also as `metrics` (a dict)."""
        if not self._has("rounds"):
            return []
        out = self._dicts("SELECT * FROM rounds ORDER BY round, run_id")
        for row in out:
            for col in _COUNT_COLUMNS:
                if f"{col}_json" in row:   # schema 2: the list where one was stored, else the count
                    listed = _loads(row.pop(f"{col}_json"))
                    row[col] = listed if listed is not None else row[col]
                else:                      # a schema-1 file opened read-only: JSON text
                    row[col] = _loads(row[col])
            row["metrics"] = _loads(row["metrics_json"]) or {}
        return out

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self._has("events"):
            return []
        if kind is None:
            return self._dicts("SELECT * FROM events ORDER BY id")
        return self._dicts("SELECT * FROM events WHERE kind = ? ORDER BY id", (kind,))

    def row_counts(self) -> dict[str, int]:
        """How many message and event rows the store holds (a checkpoint's ledger position)."""
        return {"messages": int(self._query("SELECT COUNT(*) FROM messages")[0][0]),
                "events": int(self._query("SELECT COUNT(*) FROM events")[0][0])}

    def abort_after(self, round: int) -> tuple[int, int]:
        """A resume from the checkpoint of `round`: the later rounds of the stopped attempt are
        marked, not deleted (messages 'lost' with an 'aborted:' error, events kinds prefixed
        'aborted:'), and their round rows removed.  Returns the aborted messages' count and framed
        bytes (sender side)."""
        count, framed = self._query("SELECT COUNT(*), COALESCE(SUM(framed_bytes), 0) FROM messages WHERE round > ? "
                                    "AND role = 'sender'", (round,))[0]
        self._exec("UPDATE messages SET status = 'lost', error = 'aborted: server stopped before round ' || round || "
                   "' finished; re-run after resume from round ' || ? WHERE round > ? AND error NOT LIKE 'aborted:%'",
                   (round, round))
        self._exec("UPDATE events SET kind = 'aborted:' || kind WHERE round > ? AND kind NOT LIKE 'aborted:%'",
                   (round,))
        self._exec("DELETE FROM rounds WHERE round > ?", (round,))
        return int(count), int(framed)

    def messages(self) -> list[dict[str, Any]]:
        """Every stored record (both sides of each message)."""
        if not self._has("messages"):
            return []
        return self._dicts("SELECT * FROM messages ORDER BY wall_time, msg_id, role")

    def refused_messages(self, code: str) -> list[dict[str, Any]]:
        """Receiver records of messages their receiver rejected with the typed error `code`
        (its error text starts with it), oldest first: read by SQL, so memory grows with
        them, not with the run."""
        if not self._has("messages"):
            return []
        return self._dicts("SELECT * FROM messages WHERE role = 'receiver' AND status = 'rejected' "
                           "AND substr(error, 1, ?) = ? ORDER BY wall_time, msg_id, role", (len(code), code))

    def recorders_of(self, nodes: Iterable[str]) -> dict[str, set[str]]:
        """For each of `nodes`, the processes that recorded as it (the sender of its sender records,
        the receiver of its receiver records): a logical client's hosting process.  One scan of
        the messages per `_IN_CHUNK` nodes, not one per node: a stopped run at scale can leave
        lone records from thousands of logical clients (server/resilience.py)."""
        out: dict[str, set[str]] = {node: set() for node in nodes}
        if not self._has("messages"):
            return out
        wanted = sorted(out)
        for i in range(0, len(wanted), _IN_CHUNK):
            chunk = wanted[i:i + _IN_CHUNK]
            marks = ",".join("?" * len(chunk))
            for node, recorder in self._query(
                    f"SELECT DISTINCT src, recorder FROM messages WHERE role = 'sender' AND src IN ({marks}) UNION "
                    f"SELECT DISTINCT dst, recorder FROM messages WHERE role = 'receiver' AND dst IN ({marks})",
                    (*chunk, *chunk)):
                out[node].add(recorder)
        return out

    def lone_messages(self) -> list[dict[str, Any]]:
        """Ledger records whose other end (sender or receiver) recorded nothing."""
        return self._dicts("SELECT m.* FROM messages AS m WHERE NOT EXISTS (SELECT 1 FROM messages AS o "
                           "WHERE o.msg_id = m.msg_id AND o.role != m.role)")

    def message_status(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(msg_id, role) -> that record's status and error."""
        return {(r["msg_id"], r["role"]): r for r in self._dicts("SELECT msg_id, role, status, error FROM messages")}

    def last_record_by_recorder(self) -> dict[str, float]:
        """Each recording process's newest ledger record (wall time)."""
        return dict(self._query("SELECT recorder, MAX(wall_time) FROM messages GROUP BY recorder"))

    def recording_ends(self) -> set[str]:
        """Every node named as the recording end of some record (the sender of a sender record,
        the receiver of a receiver record): logical clients recorded by their process included."""
        return {r[0] for r in self._query("SELECT DISTINCT src FROM messages WHERE role = 'sender' UNION "
                                          "SELECT DISTINCT dst FROM messages WHERE role = 'receiver'")}

    def bytes_by_link(self) -> dict[str, dict[str, int]]:
        """{link: {tensor_bytes, payload_bytes, framed_bytes, messages}} plus key "total"; each message once."""
        out: dict[str, dict[str, int]] = {}
        total = _zero()
        if self._has("messages"):
            for link, *sums in self._query(_ONCE + f"SELECT link, {_SUMS} FROM once GROUP BY link ORDER BY link"):
                out[link] = _totals(sums)
                for k in total:
                    total[k] += out[link][k]
        out["total"] = total
        return out

    def bytes_by_link_upto(self, round: int) -> dict[str, dict[str, int]]:
        """{link: {tensor_bytes, payload_bytes, framed_bytes, messages}} of the messages with round <= `round`."""
        if not self._has("messages"):
            return {}
        sql = _ONCE + f"SELECT link, {_SUMS} FROM once WHERE round <= ? GROUP BY link ORDER BY link"
        return {link: _totals(sums) for link, *sums in self._query(sql, (int(round),))}

    def bytes_by_link_direction(self) -> dict[str, dict[str, dict[str, int]]]:
        """{link: {direction: {tensor_bytes, payload_bytes, framed_bytes, messages}}}; each message once."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        if self._has("messages"):
            sql = _ONCE + f"SELECT link, direction, {_SUMS} FROM once GROUP BY link, direction ORDER BY link, direction"
            for link, direction, *sums in self._query(sql):
                out.setdefault(link, {})[direction] = _totals(sums)
        return out

    def live_bytes_by_link_direction(self) -> dict[str, dict[str, dict[str, int]]]:
        """The live view (common/transport/livebytes.py), shaped like `bytes_by_link_direction`."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        if self._has("live_bytes"):
            sql = ("SELECT link, direction, SUM(tensor_bytes), SUM(payload_bytes), SUM(framed_bytes), SUM(messages) "
                   "FROM live_bytes GROUP BY link, direction ORDER BY link, direction")
            for link, direction, *sums in self._query(sql):
                out.setdefault(link, {})[direction] = _totals(sums)
        return out

    def bytes_per_round(self, direction: str | None = None) -> dict[int, dict[str, int]]:
        """{round: {tensor_bytes, payload_bytes, framed_bytes, messages}} for rounds with traffic;
        `direction` ("up": towards the server, "down", "peer"): only messages that travel so."""
        if not self._has("messages"):
            return {}
        where, args = ("WHERE direction = ?", (direction,)) if direction is not None else ("", ())
        sql = _ONCE + f"SELECT round, {_SUMS} FROM once {where} GROUP BY round ORDER BY round"
        return {int(r): _totals(sums) for r, *sums in self._query(sql, args)}

    def cumulative_bytes_by_round(self, direction: str | None = None) -> dict[int, dict[str, int]]:
        """{round: bytes of every message with round <= this one}, over rounds with traffic or a rounds
        row (`direction`: as in `bytes_per_round`)."""
        per = self.bytes_per_round(direction)
        rounds = sorted(set(per) | {int(r["round"]) for r in self.rounds()})
        out: dict[int, dict[str, int]] = {}
        acc = _zero()
        for r in rounds:
            for k, v in per.get(r, {}).items():
                acc[k] += v
            out[r] = dict(acc)
        return out

    def check_agreement(self) -> AgreementReport:
        """Compare each message's sender and receiver records (DESIGN.md section 5)."""
        rep = AgreementReport()
        if not self._has("messages"):
            return rep
        cols = ", ".join(f"s.{c}, r.{c}" for c in _AGREE_FIELDS)
        pairs = self._query(
            f"SELECT s.msg_id, {cols} FROM messages AS s JOIN messages AS r "
            "ON s.msg_id = r.msg_id AND s.role = 'sender' AND r.role = 'receiver' ORDER BY s.msg_id")
        for msg_id, *vals in pairs:
            diff = [name for i, name in enumerate(_AGREE_FIELDS) if vals[2 * i] != vals[2 * i + 1]]
            if diff:
                rep.mismatched.append(msg_id)
                rep.mismatch_fields[msg_id] = diff
            else:
                rep.matched += 1
        lonely = self._query(
            "SELECT m.msg_id, m.role, m.status FROM messages AS m WHERE NOT EXISTS ("
            "SELECT 1 FROM messages AS o WHERE o.msg_id = m.msg_id AND o.role != m.role) ORDER BY m.msg_id")
        for msg_id, role, status in lonely:
            if role == "sender":
                (rep.lost if status == "lost" else rep.sender_only).append(msg_id)
            else:
                rep.receiver_only.append(msg_id)
        rep.ok = not (rep.mismatched or rep.sender_only or rep.receiver_only)
        return rep


def round_seconds(rows: list[dict[str, Any]]) -> list[float]:
    """Seconds a round of a run's `rounds` rows (`RunStore.rounds`), as a benchmark compares them
    with another framework's iterations: round 1 its `wall_seconds`, every later round the time
    from the previous round's row to its own (`finished`), so what the server does between two
    rounds (recording the round, the next sample) counts too.  Rows without `finished` (a run.db
    written before it was stamped): each round's `wall_seconds`."""
    stamps = [r.get("finished") for r in rows]
    if len(rows) < 2 or any(s is None for s in stamps):
        return [float(r["wall_seconds"]) for r in rows]
    ends = [float(s) for s in stamps if s is not None]
    return [float(rows[0]["wall_seconds"]), *(b - a for a, b in zip(ends, ends[1:]))]
