"""Ledger records, JSONL sink, and the SQLite run store's counting and agreement checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.ledger import (
    LINKS,
    Ledger,
    LedgerRecord,
    bytes_by_link,
    count_once,
    json_line,
    link_for,
    read_jsonl,
)

REPO = Path(__file__).resolve().parents[1]


def rec(msg_id: str, role: str = "sender", *, src: str = "client-1", dst: str = "server",
        link: str = "client-server", direction: str = "up", round: int = 1, tensor: int = 400,
        payload: int = 450, framed: int = 460, status: str = "ok", method: str = "train.reply") -> LedgerRecord:
    return LedgerRecord(run_id="run-a", round=round, step=0, src=src, dst=dst, link=link, direction=direction,
                        method=method, tensor_bytes=tensor, payload_bytes=payload, framed_bytes=framed,
                        seconds=0.01, recorder=src if role == "sender" else dst, role=role, msg_id=msg_id,
                        status=status, wall_time=1_700_000_000.0 + len(msg_id), error="")


def both(msg_id: str, **kw) -> list[LedgerRecord]:
    return [rec(msg_id, "sender", **kw), rec(msg_id, "receiver", **kw)]


# -- ledger ---------------------------------------------------------------------------------
def test_link_for_is_symmetric_and_names_links():
    assert link_for("client", "server") == link_for("server", "client") == "client-server"
    assert link_for("edge", "client") == "client-edge"
    assert link_for("server", "edge") == "edge-server"
    assert link_for("edge", "edge") == "edge-edge"
    assert all(link_for(a, b) in LINKS for a in ("client", "edge") for b in ("client", "edge", "server"))
    with pytest.raises(ValueError, match="'router'"):
        link_for("router", "server")
    with pytest.raises(ValueError, match="server"):
        link_for("server", "server")


def test_record_rejects_bad_values_and_unknown_fields():
    led = Ledger()
    good = rec("m").to_dict()
    with pytest.raises(ValueError, match="link='client-cloud'"):
        led.record(**{**good, "link": "client-cloud"})
    with pytest.raises(ValueError, match="status"):
        led.record(**{**good, "status": "maybe"})
    with pytest.raises(TypeError, match="colour"):
        led.record(**good, colour="red")
    with pytest.raises(ValueError, match="msg_id"):
        LedgerRecord.from_dict({k: v for k, v in good.items() if k != "msg_id"})
    assert led.records() == []


def test_dict_round_trip_and_default_wall_time():
    r = rec("m1")
    assert LedgerRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    led = Ledger()
    fields = {k: v for k, v in r.to_dict().items() if k not in ("wall_time", "error")}
    got = led.record(**fields)
    assert got.wall_time > 1_700_000_000 and got.error == ""


def test_jsonl_round_trip_with_torn_last_line(tmp_path):
    path = tmp_path / "ledger" / "client-1.jsonl"
    written = [rec(f"m{i}", tensor=100 * i) for i in range(3)]
    with Ledger(path) as led:
        led.extend(written)
    full = path.read_text()
    assert full.count("\n") == 3
    torn_line = json.dumps(rec("m9").to_dict())[:37]  # a process killed mid-write
    path.write_text(full + torn_line)
    with pytest.warns(UserWarning, match=r"client-1\.jsonl:4"):
        back = read_jsonl(path)
    assert back == written

    # A new ledger appending to the torn file (a resumed process) must not glue its record to the tear.
    with Ledger(path) as led:
        led.add(rec("m10"))
    with pytest.warns(UserWarning):
        back = Ledger.read_jsonl(path)
    assert [r.msg_id for r in back] == ["m0", "m1", "m2", "m10"]


def test_sigkilled_writer_leaves_every_recorded_line(tmp_path):
    path = tmp_path / "killed.jsonl"
    script = (
        "import os, signal\n"
        "from fedhop.common.wire.ledger import Ledger\n"
        f"led = Ledger({str(path)!r})\n"
        "for i in range(25):\n"
        "    led.record(run_id='r', round=i, step=0, src='client-1', dst='server', link='client-server',\n"
        "               direction='up', method='train.reply', tensor_bytes=i, payload_bytes=i + 1,\n"
        "               framed_bytes=i + 6, seconds=0.0, recorder='client-1', role='sender',\n"
        "               msg_id=f'k{i}', status='ok', wall_time=0.0)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -9
    back = read_jsonl(path)
    assert [r.round for r in back] == list(range(25))
    assert sum(r.framed_bytes for r in back) == sum(i + 6 for i in range(25))


def test_drain_hands_out_each_record_once():
    led = Ledger()
    for i in range(3):
        led.add(rec(f"a{i}"))
    assert [r.msg_id for r in led.drain()] == ["a0", "a1", "a2"]
    led.add(rec("b0"))
    led.add(rec("b1"))
    assert [r.msg_id for r in led.drain()] == ["b0", "b1"]
    assert led.drain() == []
    assert len(led.records()) == 5

    lean = Ledger(keep_drained=False)
    lean.add(rec("c0"))
    assert len(lean.drain()) == 1 and lean.records() == []
    lean.add(rec("c1"))
    assert [r.msg_id for r in lean.drain()] == ["c1"]


def test_a_ledger_that_holds_nothing_still_writes_and_counts_every_record(tmp_path):
    """hold=False (a client or edge process: its parent merges the file): every record reaches
    the file, in order and whole, and each observer, while none stays in memory."""
    seen: list[str] = []
    led = Ledger(tmp_path / "child.jsonl", hold=False)
    led.observers.append(lambda r: seen.append(r.msg_id))
    made = [rec(f"m{i}", framed=100 + i) for i in range(200)]
    for r in made[:150]:
        led.add(r)
    got = led.record(**{**made[150].to_dict(), "msg_id": "via-record"})
    for r in made[151:]:
        led.add(r)
    assert led.records() == [] and led.drain() == [] and led._records == []
    led.close()
    back = read_jsonl(tmp_path / "child.jsonl")
    assert [r.msg_id for r in back] == [r.msg_id for r in made[:150]] + ["via-record"] + [r.msg_id for r in made[151:]]
    assert back[150] == got and back[:150] == made[:150]
    assert seen == [r.msg_id for r in back]


def test_child_processes_ledgers_hold_no_records(tmp_path):
    """The ledger a client or edge process makes (common/transport/startup.py `child_setup`) and
    the in-process engine's roles' write their records to ledger/ and count them live, holding
    none; the in-process server's holds a round's until run.db drains them."""
    from fedhop.common.transport.startup import child_parser, child_setup
    from fedhop.deploy.launch import inprocess

    ap = child_parser("fedhop client", None, "server", "device")
    ap.add_argument("--node-id", default="client-proc9")
    args = ap.parse_args(["--parent", "127.0.0.1:1", "--ledger-dir", str(tmp_path / "ledger"), "--token", "t" * 32])
    setup = child_setup(args, "client", [0], threads=1)
    assert not isinstance(setup, int)
    role, role_counter = inprocess._ledger(tmp_path, "client-proc8")
    server, _ = inprocess._ledger(tmp_path, "server", hold=True)
    for led, node in ((setup.ledger, "client-proc9"), (role, "client-proc8"), (server, "server")):
        for i in range(3):   # each sent by the process to a peer: what its own live counter counts
            led.add(rec(f"x{i}", src=node, dst="client-proc7" if node != "server" else "edge-0",
                        link="client-client" if node != "server" else "edge-server", framed=10 + i))
    assert setup.ledger.records() == [] and role.records() == []
    assert [r.msg_id for r in server.drain()] == ["x0", "x1", "x2"] and server.records() == []
    for led in (setup.ledger, role, server):
        led.close()
    for name in ("client-proc9", "client-proc8", "server"):
        assert [r.framed_bytes for r in read_jsonl(tmp_path / "ledger" / f"{name}.jsonl")] == [10, 11, 12]
    assert sum(e.framed_bytes for e in setup.counter.entries()) == 33 == sum(e.framed_bytes for e in role_counter.entries())


def test_ledger_is_thread_safe(tmp_path):
    path = tmp_path / "threads.jsonl"
    led = Ledger(path)

    def work(t: int) -> None:
        for i in range(300):
            led.add(rec(f"t{t}-{i}", tensor=i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    led.close()
    assert len(led.records()) == 1200
    back = read_jsonl(path)  # no interleaved lines: every one parses
    assert len(back) == 1200 and len({r.msg_id for r in back}) == 1200
    assert sum(r.tensor_bytes for r in back) == 4 * sum(range(300))


@pytest.mark.parametrize("keep_drained", [False, True])
def test_drains_while_threads_add_hand_out_every_record_once(keep_drained):
    """`add` appends without the lock; a `drain` running meanwhile takes a prefix and leaves the
    records added after it for the next: nothing lost, nothing twice."""
    led = Ledger(keep_drained=keep_drained)

    def work(t: int) -> None:
        for i in range(5000):
            led.add(rec(f"t{t}-{i}"))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    drained: list[str] = []
    while any(th.is_alive() for th in threads):   # drains race the adds
        drained.extend(r.msg_id for r in led.drain())
    drained.extend(r.msg_id for r in led.drain())
    assert len(drained) == 20_000 and len(set(drained)) == 20_000
    assert len(led.records()) == (20_000 if keep_drained else 0)


def test_deferred_lines_are_written_once_at_the_end_and_records_seen_at_once(tmp_path):
    """`Ledger.deferred`: inside, this thread's records are held and observed at once but their
    lines wait; at the end they go in one write, in order, also after an exception; another
    thread's records are written at once; nested blocks write at the outermost's end."""
    path = tmp_path / "deferred.jsonl"
    led = Ledger(path)
    seen: list[str] = []
    led.observers.append(lambda r: seen.append(r.msg_id))
    writes: list[str] = []
    sink = led._sink
    assert sink is not None

    class Counting:
        def write(self, text: str) -> int:
            writes.append(text)
            return sink.write(text)

        def __getattr__(self, name: str):
            return getattr(sink, name)

    led._sink = Counting()   # type: ignore[assignment]

    def lines() -> list[str]:
        return [r.msg_id for r in read_jsonl(path)]

    with led.deferred():
        led.add(rec("d0"))
        with led.deferred():
            led.add(rec("d1"))
        other = threading.Thread(target=led.add, args=(rec("o0"),))
        other.start()
        other.join()
        led.add(rec("d2"))
        assert [r.msg_id for r in led.records()] == ["d0", "d1", "o0", "d2"] and seen == ["d0", "d1", "o0", "d2"]
        assert lines() == ["o0"]                     # only the other thread's, written at once
    assert lines() == ["o0", "d0", "d1", "d2"] and len(writes) == 2
    with pytest.raises(RuntimeError):
        with led.deferred():
            led.add(rec("e0"))
            led.add(rec("e1"))
            raise RuntimeError("a failed bundle")
    led.add(rec("f0"))                               # after the block: one write a record again
    assert lines() == ["o0", "d0", "d1", "d2", "e0", "e1", "f0"] and len(writes) == 4


# -- run store ------------------------------------------------------------------------------
def mixed_records() -> list[LedgerRecord]:
    """m1 both sides agree; m2 receiver only; m3 both sides, receiver disagrees; m4 sender only;
    m5 lost (sender only, status lost)."""
    return [
        *both("m1"),
        rec("m2", "receiver", src="server", dst="client-1", direction="down", tensor=400, payload=440, framed=445,
            method="train"),
        rec("m3", "sender", src="edge-0", dst="server", link="edge-server", tensor=800, payload=850, framed=860,
            round=2),
        rec("m3", "receiver", src="edge-0", dst="server", link="edge-server", tensor=800, payload=851, framed=861,
            round=2),
        rec("m4", "sender", src="client-2", dst="server", link="control", direction="control", tensor=0,
            payload=30, framed=35, round=0, method="register"),
        rec("m5", "sender", src="server", dst="client-3", direction="down", tensor=400, payload=440, framed=445,
            status="lost", round=2, method="train"),
    ]


# Hand computation for mixed_records, each message once (sender's record preferred):
# client-server: m1 (400/450/460) + m2 (400/440/445) + m5 (400/440/445) = 1200/1330/1350, 3 messages
# edge-server:   m3 sender (800/850/860), 1 message
# control:       m4 (0/30/35), 1 message
HAND = {
    "client-server": {"tensor_bytes": 1200, "payload_bytes": 1330, "framed_bytes": 1350, "messages": 3},
    "edge-server": {"tensor_bytes": 800, "payload_bytes": 850, "framed_bytes": 860, "messages": 1},
    "control": {"tensor_bytes": 0, "payload_bytes": 30, "framed_bytes": 35, "messages": 1},
    "total": {"tensor_bytes": 2000, "payload_bytes": 2210, "framed_bytes": 2245, "messages": 5},
}


def test_insert_same_records_twice_counts_once(tmp_path):
    store = RunStore(tmp_path / "run.db")
    store.start_run("run-a", name="t")
    records = mixed_records()
    assert store.insert_records(records) == len(records)
    assert store.insert_records(records) == 0
    assert store.insert_records([r.to_dict() for r in reversed(records)]) == 0
    assert len(store.messages()) == len(records)
    assert store.bytes_by_link() == HAND


def test_bytes_by_link_counts_each_message_once(tmp_path):
    store = RunStore(tmp_path)  # a directory: the store lives in run.db inside it
    assert store.path == tmp_path / "run.db"
    store.insert_records(mixed_records())
    assert store.bytes_by_link() == HAND
    assert bytes_by_link(mixed_records()) == HAND  # the in-memory twin agrees
    assert {r.msg_id: r.role for r in count_once(mixed_records())} == {
        "m1": "sender", "m2": "receiver", "m3": "sender", "m4": "sender", "m5": "sender"}
    by_dir = store.bytes_by_link_direction()
    assert by_dir["client-server"]["up"] == {"tensor_bytes": 400, "payload_bytes": 450, "framed_bytes": 460,
                                             "messages": 1}
    assert by_dir["client-server"]["down"]["payload_bytes"] == 880
    assert by_dir["control"]["control"]["messages"] == 1


def test_bytes_per_round_and_cumulative(tmp_path):
    store = RunStore(tmp_path / "run.db", run_id="run-a")
    store.insert_records(mixed_records())
    store.add_round(3, metrics={"test_accuracy": 0.5})  # a round without traffic carries the sum forward
    per = store.bytes_per_round()
    assert {r: v["tensor_bytes"] for r, v in per.items()} == {0: 0, 1: 800, 2: 1200}
    assert {r: v["framed_bytes"] for r, v in per.items()} == {0: 35, 1: 905, 2: 1305}
    cum = store.cumulative_bytes_by_round()
    assert {r: v["framed_bytes"] for r, v in cum.items()} == {0: 35, 1: 940, 2: 2245, 3: 2245}
    assert cum[3]["messages"] == 5


def test_check_agreement_flags_each_kind_of_disagreement(tmp_path):
    store = RunStore(tmp_path / "run.db")
    store.insert_records(mixed_records())
    rep = store.check_agreement()
    assert rep.matched == 1
    assert rep.mismatched == ["m3"]
    assert rep.mismatch_fields == {"m3": ["payload_bytes", "framed_bytes"]}
    assert rep.receiver_only == ["m2"]
    assert rep.sender_only == ["m4"]
    assert rep.lost == ["m5"]
    assert rep.ok is False
    assert "DISAGREE" in rep.summary() and "1 mismatched" in rep.summary()

    clean = RunStore(tmp_path / "clean.db")
    clean.insert_records([*both("x1"), *both("x2", src="edge-1", dst="edge-2", link="edge-edge", direction="peer"),
                          rec("x3", status="lost")])
    rep = clean.check_agreement()
    assert (rep.ok, rep.matched, rep.lost) == (True, 2, ["x3"])

    swapped = RunStore(tmp_path / "swapped.db")
    swapped.insert_records([rec("y1"), rec("y1", "receiver", dst="edge-0", link="client-edge")])
    rep = swapped.check_agreement()
    assert rep.mismatch_fields == {"y1": ["dst", "link"]} and not rep.ok


def test_runs_rounds_events_round_trip(tmp_path):
    store = RunStore(tmp_path / "run.db")
    store.start_run("run-a", name="fedavg-digits", algorithm="fedavg", topology="star", transport="grpc",
                    config_toml="[run]\nrounds = 2\n", started=10.0)
    store.add_round(1, participants=[3, 1], sampled=[3, 1, 4], failures=[4], metrics={"test_accuracy": 0.25},
                    wall_seconds=1.5, sim_seconds=2.0)
    store.add_round(1, participants=[3, 1, 4], sampled=[3, 1, 4], failures=[], metrics={"test_accuracy": 0.3})
    store.add_round(2, metrics={"test_accuracy": 0.6, "objective": 1.25})
    store.add_event("client_failed", node="client-4", detail={"reason": "killed"}, round=1, time=11.0)
    store.add_event("timeout", node="edge-0", detail="deadline", round=2)
    store.finish_run("completed", finished=20.0)
    store.close()

    again = RunStore(tmp_path / "run.db", create=False)  # a fresh reader, as the report opens it
    assert again.run_id == "run-a"
    run = again.run()
    assert (run["status"], run["finished"], run["algorithm"]) == ("completed", 20.0, "fedavg")
    rounds = again.rounds()
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[0]["participants"] == [3, 1, 4] and rounds[0]["metrics"] == {"test_accuracy": 0.3}
    assert rounds[1]["metrics"]["objective"] == 1.25
    assert [e["kind"] for e in again.events()] == ["client_failed", "timeout"]
    failed = again.events("client_failed")
    assert len(failed) == 1 and json.loads(failed[0]["detail"]) == {"reason": "killed"}

    # A resumed run re-opens the same row.
    store = RunStore(tmp_path / "run.db")
    store.start_run("run-a", name="fedavg-digits")
    assert store.run()["status"] == "running" and store.run()["started"] == 10.0


def test_reader_of_missing_or_partial_db(tmp_path):
    with pytest.raises(FileNotFoundError, match="run.db"):
        RunStore(tmp_path / "nope" / "run.db", create=False)
    import sqlite3
    conn = sqlite3.connect(tmp_path / "partial.db")
    conn.execute("CREATE TABLE runs(run_id TEXT, name TEXT, started REAL, status TEXT)")
    conn.commit()
    conn.close()
    store = RunStore(tmp_path / "partial.db", create=False)
    assert store.rounds() == [] and store.messages() == [] and store.events() == []
    assert store.bytes_by_link()["total"]["messages"] == 0
    assert store.check_agreement().ok


def test_store_from_several_threads_and_anonymous_ids(tmp_path):
    store = RunStore(tmp_path / "run.db", run_id="run-a")

    def work(t: int) -> None:
        for i in range(50):
            store.insert_records(both(f"t{t}-{i}", tensor=t + 1))
            store.add_event("skip", node=f"client-{t}", round=i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = store.bytes_by_link()["total"]
    assert total["messages"] == 200 and total["tensor_bytes"] == 50 * (1 + 2 + 3 + 4)
    assert len(store.events("skip")) == 200

    anon = rec("", tensor=7)
    assert store.insert_records([anon]) == 1
    assert store.insert_records([anon]) == 0  # content-derived id: still idempotent
    assert store.bytes_by_link()["total"]["tensor_bytes"] == 50 * 10 + 7


def test_insert_jsonl_merges_a_child_ledger(tmp_path):
    path = tmp_path / "edge-0.jsonl"
    with Ledger(path) as led:
        led.extend(mixed_records())
    store = RunStore(tmp_path / "run.db")
    assert store.insert_jsonl(path) == len(mixed_records())
    assert store.insert_jsonl(path) == 0
    assert store.bytes_by_link() == HAND


@pytest.mark.parametrize("text", ["plain", 'quote " and \\ backslash', "é 日本 🚀", "tab\tnl\ncr\r\x00\x1f", ""])
@pytest.mark.parametrize("seconds", [0.0, -0.0, 0.1, 1e-300, 1.7976931348623157e308, float("nan"), float("inf"),
                                     float("-inf"), 3, True])
def test_a_ledger_line_is_the_json_modules_text(text, seconds, tmp_path):
    """`json_line` writes a record as `json.JSONEncoder(separators=(",", ":"))` does, for any text
    and float (NaN, the infinities, -0.0), and a field of another type than its annotation (an
    int or a bool for a float) takes json's own way; each line reads back as the record."""
    r = LedgerRecord(run_id=text, round=2 ** 62, step=0, src=text, dst="server", link="client-server",
                     direction="up", method=f"train.{text}", tensor_bytes=0, payload_bytes=5, framed_bytes=10,
                     seconds=seconds, recorder="server", role="receiver", msg_id=text, status="ok",
                     wall_time=seconds if isinstance(seconds, float) else 1.5, error=text)
    assert json_line(r) == json.JSONEncoder(separators=(",", ":")).encode(r.to_dict())
    led = Ledger(tmp_path / "l.jsonl")
    led.add(r)
    led.close()
    back = read_jsonl(tmp_path / "l.jsonl")
    assert len(back) == 1 and back[0].msg_id == text and back[0].round == 2 ** 62
