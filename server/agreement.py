"""The ledger agreement verdict that summary.json, `fedhop report` and `fedhop merge-ledgers`
print (DESIGN.md section 5: "the sender's and receiver's records must agree; the report says so").

`RunStore.check_agreement` pairs each message's two records; a record without its other end is
one-sided.  A one-sided record is not by itself a disagreement: a message whose loss the run
recorded (the sender saw the call fail, the receiver rejected it, the receiving process died,
the sender was killed before it recorded it, ...) is an *explained loss*, classified by
`ledger_consistency` (server/resilience.py), the same rule the fault tests use.  The verdict
agrees when no pair mismatches (a pair cut off on the way, one side recorded lost or rejected,
is a partial loss, not a mismatch), no one-sided record is unexplained, and no one-sided record
is explained only by its other end keeping no ledger in run.db: that is a ledger missing from
the merge (a server on another machine that has not gathered its clients' ledgers yet), not a
loss.

Counting is done in SQLite, so a run.db of millions of records is judged in bounded memory; the
one-sided records are classified one by one (in memory that grows with their number, each
message's status looked up in run.db when needed) where there are at most `CLASSIFY_LIMIT` of
them with the mismatched pairs.  Beyond that (a crafted ledger of invented messages), every
one-sided record that is not a recorded loss counts as unexplained, and the verdict says it was
not classified.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedhop.common.records.runstore import AgreementReport

CLASSIFY_LIMIT = 50_000   # one-sided and mismatched records up to which they are classified one by one

_LONE = ("FROM messages AS m WHERE NOT EXISTS (SELECT 1 FROM messages AS o "
         "WHERE o.msg_id = m.msg_id AND o.role != m.role)")
_PAIR_DIFF = " OR ".join(f"s.{c} IS NOT r.{c}" for c in
                         ("tensor_bytes", "payload_bytes", "framed_bytes", "src", "dst", "link"))


@dataclass
class Verdict:
    """Counts of the ledger check; `ok` is the verdict (module docstring)."""

    ok: bool = True
    matched: int = 0
    mismatched: int = 0          # pairs whose two records differ, partial losses included
    partial_losses: int = 0      # of those, pairs cut off on the way (one side lost or rejected)
    sender_only: int = 0
    receiver_only: int = 0
    lost: int = 0                # one-sided sender records with status 'lost'
    explained: int = 0           # one-sided records whose loss is recorded ('lost' ones included)
    unexplained: int = 0         # one-sided records without a recorded loss
    no_ledger: int = 0           # one-sided records whose other end keeps no ledger in run.db
    classified: bool = True      # False: too many records to classify one by one

    def as_dict(self) -> dict[str, Any]:
        """summary.json's `ledger_agreement`."""
        return asdict(self)

    def summary(self) -> str:
        """One line: the verdict and its counts."""
        head = "sender and receiver records agree" if self.ok else "sender and receiver records DISAGREE"
        parts = [f"{self.matched} matched", f"{self.mismatched - self.partial_losses} mismatched",
                 f"{self.sender_only} sender-only", f"{self.receiver_only} receiver-only",
                 f"{self.explained} one-sided explained by a recorded loss", f"{self.unexplained} unexplained"]
        if self.partial_losses:
            parts.append(f"{self.partial_losses} cut off on the way (recorded)")
        if self.no_ledger:
            parts.append(f"{self.no_ledger} whose other end's ledger is not in run.db")
        if not self.classified:
            parts.append(f"not classified (over {CLASSIFY_LIMIT} one-sided or mismatched records)")
        return f"{head}: " + ", ".join(parts)


def bounded_consistency(store: Any) -> dict:
    """`ledger_consistency` (server/resilience.py, summary.json's faults.ledger) over `store` in
    memory that grows with its one-sided and mismatched records only (`_Bounded`), not with the
    run: the matched pairs are counted in SQLite."""
    from fedhop.server.resilience import ledger_consistency  # torch and the roles: only where needed
    if not store._has("messages"):
        return ledger_consistency(store)
    pairs, mismatched = store._query("SELECT COUNT(*), COALESCE(SUM(CASE WHEN " + _PAIR_DIFF + " THEN 1 ELSE 0 END), 0) "
                                     "FROM messages AS s JOIN messages AS r ON s.msg_id = r.msg_id "
                                     "AND s.role = 'sender' AND r.role = 'receiver'")[0]
    return ledger_consistency(_Bounded(store, int(pairs) - int(mismatched)))


def _count(store: Any, sql: str, params: tuple = ()) -> int:
    rows = store._query(sql, params)
    return int(rows[0][0] or 0) if rows else 0


def ledger_verdict(store: Any, classify_limit: int = CLASSIFY_LIMIT) -> Verdict:
    """The agreement verdict over a RunStore's messages (module docstring)."""
    v = Verdict()
    if not store._has("messages"):
        return v
    pairs = store._query("SELECT COUNT(*), COALESCE(SUM(CASE WHEN " + _PAIR_DIFF + " THEN 1 ELSE 0 END), 0), "
                         "COALESCE(SUM(CASE WHEN (" + _PAIR_DIFF + ") AND (s.status != 'ok' OR r.status != 'ok') "
                         "THEN 1 ELSE 0 END), 0) FROM messages AS s JOIN messages AS r ON s.msg_id = r.msg_id "
                         "AND s.role = 'sender' AND r.role = 'receiver'")[0]
    v.mismatched, v.partial_losses = int(pairs[1]), int(pairs[2])
    v.matched = int(pairs[0]) - v.mismatched
    for role, lost, n in store._query("SELECT m.role, m.status = 'lost', COUNT(*) " + _LONE + " GROUP BY 1, 2"):
        if role == "sender" and lost:
            v.lost += int(n)
        elif role == "sender":
            v.sender_only += int(n)
        else:
            v.receiver_only += int(n)
    lone = v.sender_only + v.receiver_only
    if lone and lone + v.mismatched <= classify_limit:
        from fedhop.server.resilience import ledger_consistency  # torch and the roles: only where needed
        report = ledger_consistency(_Bounded(store, v.matched))
        v.explained, v.unexplained = int(report["lost_explained"]), int(report["unexplained"])
        v.partial_losses = int(report["partial_losses"])
        v.no_ledger = _no_ledger(store)
        v.explained = max(0, v.explained - v.no_ledger)   # ledger_consistency counts them as explained
    else:
        v.explained, v.unexplained, v.classified = v.lost, lone, not lone
    v.ok = v.mismatched == v.partial_losses and v.unexplained == 0 and v.no_ledger == 0
    return v


class _Status:
    """`RunStore.message_status` looked up one message at a time instead of read whole."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def get(self, key: tuple[str, str], default: Any = None) -> Any:
        rows = self.store._dicts("SELECT msg_id, role, status, error FROM messages WHERE msg_id = ? AND role = ?", key)
        return rows[0] if rows else default


class _Bounded:
    """A RunStore as `ledger_consistency` reads it, in memory that grows with the one-sided and
    mismatched records only: each message's status looked up when asked for (`_Status`), and the
    pairs' check reduced to the count of matched pairs and the mismatched ids."""

    def __init__(self, store: Any, matched: int) -> None:
        self._store, self._matched = store, matched

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def message_status(self) -> _Status:
        return _Status(self._store)

    def check_agreement(self) -> AgreementReport:
        ids = [r[0] for r in self._store._query(
            "SELECT s.msg_id FROM messages AS s JOIN messages AS r ON s.msg_id = r.msg_id AND s.role = 'sender' "
            "AND r.role = 'receiver' WHERE " + _PAIR_DIFF)]
        return AgreementReport(matched=self._matched, mismatched=ids, ok=not ids)


def _no_ledger(store: Any) -> int:
    """One-sided records that only the other end's missing ledger explains: status ok, no error,
    not a reply, and the other end neither records anything in run.db nor was recorded failed."""
    from fedhop.server.resilience import LOSS_EVENTS
    failed = ", ".join("?" for _ in LOSS_EVENTS)
    failed_sql = (f"SELECT node FROM events WHERE kind IN ({failed}) OR kind LIKE 'aborted:%'"
                  if store._has("events") else "SELECT '' WHERE 0")
    far = "CASE WHEN m.role = 'sender' THEN m.dst ELSE m.src END"
    return _count(store, f"SELECT COUNT(*) {_LONE} AND m.status = 'ok' AND m.error = '' "
                         "AND m.msg_id NOT LIKE '%.reply' "
                         f"AND {far} NOT IN (SELECT src FROM messages WHERE role = 'sender' "
                         "UNION SELECT dst FROM messages WHERE role = 'receiver') "
                         f"AND {far} NOT IN ({failed_sql})",
                  tuple(LOSS_EVENTS) if store._has("events") else ())
