"""Reading a run directory without writing to it: the per-round table and the ledger totals that
the Python API (`fedhop.load`, deploy/api.py) returns and `fedhop report --csv` writes.

run.db is opened read-only (`connect_ro`, common/records/walfold.py): reading a run never changes
it, whether it is finished, still going or on a read-only disk.  Bytes count each message once,
as `RunStore` does (`_ONCE`: every sender record, plus receiver records whose sender record is
missing).  Round r means r rounds completed; a round's cumulative bytes are those of every
message with round <= r (round 0: registration and the first model), so they match `fedhop
report`'s bytes to target.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from fedhop.common.records.runstore import _ONCE
from fedhop.common.records.walfold import connect_ro
from fedhop.common.wire.ledger import BYTE_FIELDS

#: the per-round columns every row has, in order; each metric of the round comes after them,
#: then the cumulative byte counts (CUMULATIVE)
ROUND_COLUMNS: tuple[str, ...] = ("round", "participants", "sampled", "failures", "clients_dropped",
                                  "wall_seconds", "sim_seconds")
COUNT_FIELDS: tuple[str, ...] = ("messages", *BYTE_FIELDS)
CUMULATIVE: tuple[str, ...] = tuple(f"cumulative_{k}" for k in COUNT_FIELDS)


MAX_SUMMARY_BYTES = 16 << 20   # a summary is a few kB; a larger file is refused unread
MAX_COUNT = (1 << 63) - 1       # the largest count a run.db column holds


def load_json_file(path: Path, limit: int = MAX_SUMMARY_BYTES) -> Any:
    """A JSON file of at most `limit` bytes; ValueError naming the file where it is larger, not
    JSON, nested too deeply for the parser or holds an integer of over 4300 digits."""
    path = Path(path)
    with open(path, "rb") as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, int digits over the limit
        raise ValueError(f"{path}: not valid JSON ({str(exc)[:200]})") from None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def summary_problem(data: Any) -> str | None:
    """What is wrong with the fields of a summary.json that readers use, or None: a JSON object;
    text fields text; `final` an object; counts non-negative integers below 2^63; `bytes.total`
    and each `bytes.by_link` entry objects of counts."""
    if not isinstance(data, dict):
        return "not a JSON object"
    for key in ("name", "status", "algorithm", "topology", "transport", "run_id", "error"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return f"{key} = {str(data[key])[:60]!r} is not text"
    for key in ("rounds_completed", "rounds_planned", "failures", "num_clients"):
        if data.get(key) is not None and not _is_count(data[key]):
            return f"{key} = {str(data[key])[:60]!r} is not a count"
    if data.get("final") is not None and not isinstance(data["final"], dict):
        return "final is not an object"
    wall = data.get("wall_seconds")
    if wall is not None and (isinstance(wall, bool) or not isinstance(wall, (int, float)) or abs(wall) > 1e300):
        return f"wall_seconds = {str(wall)[:60]!r} is not a number of seconds"
    counts = ("messages", *BYTE_FIELDS)
    b = data.get("bytes")
    if b is None:
        return None
    if not isinstance(b, dict):
        return "bytes is not an object"
    rows = [("bytes.total", b.get("total"))] + [
        (f"bytes.by_link.{link}", row) for link, row in (b.get("by_link") or {}).items()] \
        if isinstance(b.get("by_link") or {}, dict) else None
    if rows is None:
        return "bytes.by_link is not an object"
    for where, row in rows:
        if row is None:
            continue
        if not isinstance(row, dict):
            return f"{where} is not an object"
        for k in counts:
            if row.get(k) is not None and not _is_count(row[k]):
                return f"{where}.{k} = {str(row[k])[:60]!r} is not a count"
    return None


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json as a dict ({} where the run wrote none); ValueError naming the file where it is
    larger than MAX_SUMMARY_BYTES, not JSON, or its fields have the wrong types (`summary_problem`)."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return {}
    data = load_json_file(path)
    problem = summary_problem(data)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return data


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def zero_totals() -> dict[str, int]:
    return {k: 0 for k in COUNT_FIELDS}


def _sums(values) -> dict[str, int]:
    messages, *byte_sums = values
    return {"messages": int(messages or 0), **{k: int(v or 0) for k, v in zip(BYTE_FIELDS, byte_sums)}}


_SUMS = "COUNT(*), " + ", ".join(f"SUM({k})" for k in BYTE_FIELDS)


def ledger_totals(con: sqlite3.Connection) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(total, by link): messages, tensor, payload and framed bytes, each message counted once."""
    by_link: dict[str, dict[str, int]] = {}
    if "messages" in _tables(con):
        for link, *values in con.execute(_ONCE + f"SELECT link, {_SUMS} FROM once GROUP BY link ORDER BY link"):
            by_link[link] = _sums(values)
    total = zero_totals()
    for row in by_link.values():
        for k in COUNT_FIELDS:
            total[k] += row[k]
    return total, by_link


def _count(value: Any) -> int | None:
    """A rounds count column: an INTEGER (schema 2) or JSON text of a count or a list (schema 1)."""
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, list):
        return len(value)
    return None if value is None else int(value)


def _run_id(con: sqlite3.Connection, tables: set[str]) -> str | None:
    """The run the rounds belong to: the latest started (as `RunStore` picks it)."""
    if "runs" not in tables:
        return None
    row = con.execute("SELECT run_id FROM runs ORDER BY started DESC LIMIT 1").fetchone()
    return row[0] if row else None


def round_rows(con: sqlite3.Connection) -> list[dict[str, Any]]:
    """One dict per recorded round, in round order: ROUND_COLUMNS, the round's metrics (their own
    names; one that would hide a column is prefixed `metric_`), then CUMULATIVE."""
    tables = _tables(con)
    if "rounds" not in tables:
        return []
    have = {r[1] for r in con.execute("PRAGMA table_info(rounds)")}
    run_id = _run_id(con, tables)
    where, params = ("WHERE run_id = ?", (run_id,)) if run_id is not None else ("", ())
    cols = [c for c in ROUND_COLUMNS if c in have] + ["metrics_json"]
    rows = con.execute(f"SELECT {', '.join(cols)} FROM rounds {where} ORDER BY round", params).fetchall()
    per_round: dict[int, dict[str, int]] = {}
    if "messages" in tables:
        per_round = {int(r): _sums(values) for r, *values in
                     con.execute(_ONCE + f"SELECT round, {_SUMS} FROM once GROUP BY round ORDER BY round")}
    traffic = sorted(per_round.items())
    upto, next_ = zero_totals(), 0
    out = []
    for values in rows:   # in round order: add the traffic of each round up to this one once
        raw = dict(zip(cols, values))
        row: dict[str, Any] = {"round": int(raw["round"])}
        for c in ("participants", "sampled", "failures", "clients_dropped"):
            row[c] = _count(raw.get(c))
        row["wall_seconds"] = raw.get("wall_seconds")
        row["sim_seconds"] = raw.get("sim_seconds")
        for name, value in (json.loads(raw["metrics_json"] or "{}")).items():
            row[f"metric_{name}" if name in ROUND_COLUMNS or name in CUMULATIVE else name] = value
        while next_ < len(traffic) and traffic[next_][0] <= row["round"]:
            for k in COUNT_FIELDS:
                upto[k] += traffic[next_][1][k]
            next_ += 1
        row.update({f"cumulative_{k}": upto[k] for k in COUNT_FIELDS})
        out.append(row)
    return out


def read_run_db(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, dict[str, int]]]:
    """(round rows, ledger total, ledger by link) of `run_dir`/run.db, read-only; ValueError naming
    the file where a column holds what no run writes."""
    db = Path(run_dir) / "run.db"
    con = connect_ro(db)
    try:
        rows = round_rows(con)
        total, by_link = ledger_totals(con)
    except (RecursionError, TypeError, OverflowError, AttributeError, KeyError, ValueError) as exc:
        # a crafted file: JSON nested too deeply in a column, text where a number belongs
        raise ValueError(f"{db}: unreadable content ({type(exc).__name__}: {str(exc)[:200]})") from None
    except sqlite3.DatabaseError as exc:   # not an SQLite file, or a damaged one
        raise ValueError(f"{db}: not a readable run database ({exc})") from None
    finally:
        con.close()
    return rows, total, by_link


def run_status(run_dir: Path) -> str | None:
    """The status run.db's runs table records for the run (None where it has none)."""
    db = Path(run_dir) / "run.db"
    con = connect_ro(db)
    try:
        tables = _tables(con)
        run_id = _run_id(con, tables)
        if run_id is None:
            return None
        row = con.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return row[0] if row and row[0] else None
    except sqlite3.DatabaseError as exc:   # not an SQLite file, or a damaged one
        raise ValueError(f"{db}: not a readable run database ({exc})") from None
    finally:
        con.close()


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of `rows` in table order: ROUND_COLUMNS, the metrics (sorted), CUMULATIVE."""
    fixed = set(ROUND_COLUMNS) | set(CUMULATIVE)
    metrics = sorted({k for row in rows for k in row if k not in fixed})
    return [*ROUND_COLUMNS, *metrics, *CUMULATIVE]
