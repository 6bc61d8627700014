"""What the server reads from run.db as it finalizes a run (server/resilience.py `record_refusals`
and `fault_summary`, server/agreement.py `bounded_consistency`): the same answers as reading
every record into memory, in memory that does not grow with the run's length (a client
process's ledger grows by two records a message: a 1,000-sampled run of 10,000 rounds is tens of
millions of records).

The answers are checked against `ledger_consistency` reading the whole store (its unbounded
form) and against counts made here; the memory by a child process's own peak resident size
(VmHWM) before and after, on a run.db of 300,000 records."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.ledger import LedgerRecord
from fedhop.server.agreement import bounded_consistency
from fedhop.server.resilience import ledger_consistency, record_refusals


def _rec(msg_id: str, role: str, *, src: str = "server", dst: str = "client-3", recorder: str = "",
         status: str = "ok", error: str = "", framed: int = 120, wall: float = 1.0, round: int = 1,
         method: str = "train") -> LedgerRecord:
    link = "control" if method.startswith("control") else "client-server"
    return LedgerRecord(run_id="r", round=round, step=0, src=src, dst=dst, link=link,
                        direction="down" if src == "server" else "up", method=method, tensor_bytes=100,
                        payload_bytes=110, framed_bytes=framed, seconds=0.01,
                        recorder=recorder or (src if role == "sender" else "client-proc0"), role=role,
                        msg_id=msg_id, status=status, wall_time=wall, error=error)


def _store(path: Path, matched: int) -> tuple[RunStore, list[LedgerRecord]]:
    store = RunStore(path)
    store.start_run(run_id="r", name="r")
    records = []
    for i in range(matched):   # both ends of each message, agreeing
        records += [_rec(f"m{i}", "sender"), _rec(f"m{i}", "receiver")]
    return store, records


def test_bounded_consistency_equals_reading_every_record(tmp_path):
    store, records = _store(tmp_path / "run.db", 50)
    records += [
        _rec("x1", "sender"), _rec("x1", "receiver", framed=999),                          # mismatched bytes
        _rec("x2", "sender", status="lost", error="UNAVAILABLE"), _rec("x2", "receiver", framed=7),  # cut off
        _rec("x3", "sender", status="lost", error="DEADLINE"),                             # lone, recorded lost
        _rec("x4", "receiver", src="client-8", dst="server", recorder="server",
             status="rejected", error="NOT_FINITE: w"),                                    # lone, rejected
        _rec("x5", "sender", status="lost", error="cut"),                                  # the request of ...
        _rec("x5.reply", "receiver", src="client-3", dst="server", recorder="server"),     # ... a lone reply
        # a logical client's message whose hosting process (client-proc1) stopped recording before it
        _rec("k0", "sender", src="client-9", dst="server", recorder="client-proc1", wall=2.0),
        _rec("k0", "receiver", src="client-9", dst="server", recorder="server", wall=2.0),
        _rec("x6", "receiver", src="client-9", dst="server", recorder="server", wall=5.0),
        _rec("x7", "sender", dst="client-3", wall=6.0),                                    # unexplained
    ]
    store.insert_records(records)
    whole = ledger_consistency(store)
    assert bounded_consistency(store) == whole
    assert whole["matched"] == 51 and whole["mismatched"] == 1 and whole["partial_losses"] == 1
    assert whole["unexplained"] == 1 and whole["unexplained_first"][0]["msg_id"] == "x7"
    assert whole["lost_explained"] == 5   # x3, x4, x5, x5.reply and x6 (its sender's process stopped first)


def test_record_refusals_adds_one_event_per_refused_call(tmp_path):
    store, records = _store(tmp_path / "run.db", 20)
    refused = [_rec(f"n{i}", "receiver", src="client-7", dst="client-3", status="rejected",
                    error=f"NOT_ALLOWED: client-7 may not call train (round {i})", round=i) for i in range(1, 4)]
    others = [_rec("o1", "receiver", status="rejected", error="NOT_FINITE: w"),          # another code
              _rec("o2", "sender", status="rejected", error="NOT_ALLOWED: a sender's record"),
              _rec("o3", "receiver", status="ok", error="NOT_ALLOWED: not rejected"),
              _rec("o4", "receiver", status="rejected", error="not_allowed: another case")]
    store.insert_records(records + refused + others)
    assert record_refusals(store) == 3
    events = store.events("not_allowed")
    assert sorted(e["detail"].rsplit("message ", 1)[-1] for e in events) == ["n1", "n2", "n3"]
    assert sorted(e["round"] for e in events) == [1, 2, 3] and {e["node"] for e in events} == {"client-7"}
    assert record_refusals(store) == 0   # idempotent


CHILD = """
import sys
from fedhop.common.records.runstore import RunStore
from fedhop.server.resilience import fault_summary, record_refusals
def hwm():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
store = RunStore(sys.argv[1], create=False)
store.events()
before = hwm()
added = record_refusals(store)
ledger = fault_summary(store)["faults"]["ledger"]
print(added, ledger["matched"], ledger["ok"], hwm() - before)
"""


def test_finalizing_a_long_runs_store_reads_it_in_bounded_memory(tmp_path):
    store, records = _store(tmp_path / "run.db", 150_000)
    records.append(_rec("n1", "receiver", src="client-7", status="rejected", error="NOT_ALLOWED: no"))
    store.insert_records(records)
    store.close()
    del records
    out = subprocess.run([sys.executable, "-c", CHILD, "run.db"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    added, matched, ok, grew_kib = out.stdout.split()
    assert (int(added), int(matched), ok) == (1, 150_000, "True")
    # every record read into dicts held about 1.5 kB each (over 400 MB here); SQLite's page cache is 2 MB
    assert int(grew_kib) < 48 * 1024, f"the child's peak grew {grew_kib} KiB reading 300,001 records"
