"""The server's own ledger file at the end of a run: its records were drained into run.db round by
round, so the merge reads only the part a predecessor wrote (a server before a resume), unless an
insert of drained records did not commit; every other process's file is read whole."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.ledger import Ledger, iter_jsonl
from fedhop.server.coordinator import Coordinator
from fedhop.transports.inmemory.endpoint import InMemoryEndpoint, InMemoryNetwork

FIELDS = {"run_id": "r", "round": 1, "step": 0, "src": "server", "dst": "client-0", "link": "client-server",
          "direction": "down", "method": "train", "tensor_bytes": 10, "payload_bytes": 20, "framed_bytes": 30,
          "seconds": 0.01, "recorder": "server", "role": "sender", "status": "ok", "wall_time": 1.0}


def line(msg_id: str) -> str:
    return json.dumps(dict(FIELDS, msg_id=msg_id)) + "\n"


def stored_ids(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {row[0] for row in conn.execute("SELECT msg_id FROM messages")}


def test_a_ledger_knows_where_its_own_records_begin_after_a_predecessors_torn_line(tmp_path):
    path = tmp_path / "server.jsonl"
    path.write_text(line("old-1") + line("old-2")[:25])   # a predecessor killed mid-line
    ledger = Ledger(path)
    ledger.record(**dict(FIELDS, msg_id="new-1"))
    ledger.close()
    text = path.read_bytes()
    assert ledger.own_from == len(line("old-1")) + 25 + 1   # after the newline that ends the torn line
    with pytest.warns(UserWarning, match=":2: skipping unreadable ledger line"):   # the torn one
        assert [r.msg_id for r in iter_jsonl(path, stop=ledger.own_from)] == ["old-1"]
    assert json.loads(text[ledger.own_from:])["msg_id"] == "new-1"
    assert Ledger().own_from == 0 and Ledger(tmp_path / "fresh.jsonl").own_from == 0


def test_merge_reads_a_stored_file_only_before_its_offset_and_every_other_file_whole(tmp_path):
    folder = tmp_path / "ledger"
    folder.mkdir()
    (folder / "server.jsonl").write_text(line("s-old") + line("s-own"))
    (folder / "client-proc0.jsonl").write_text(line("c-1") + line("c-2"))
    store = RunStore(tmp_path / "run.db")
    offset = len(line("s-old"))
    # another spelling of the same path names the same file
    assert store.merge_ledger_dir(folder, {folder / ".." / "ledger" / "server.jsonl": offset}) == 3
    store.close()
    # "s-own" lies after the offset: it was not read (it is in no run.db here, so reading it would have stored it)
    assert stored_ids(tmp_path / "run.db") == {"s-old", "c-1", "c-2"}
    store = RunStore(tmp_path / "run.db")
    assert store.merge_ledger_dir(folder) == 1   # `fedhop merge-ledgers`: every file whole
    store.close()
    assert stored_ids(tmp_path / "run.db") == {"s-old", "s-own", "c-1", "c-2"}


@pytest.fixture
def coordinator(tmp_path):
    run = tmp_path / "run"
    (run / "ledger").mkdir(parents=True)
    (run / "ledger" / "server.jsonl").write_text(line("before-resume"))   # a predecessor's record
    (run / "ledger" / "client-proc0.jsonl").write_text(line("client-1"))
    cfg = parse_config("[clients]\ncount = 4\nprocesses = 1\n[run]\nrounds = 1\n")
    ledger = Ledger(run / "ledger" / "server.jsonl", keep_drained=False)
    coord = Coordinator(cfg, run, InMemoryEndpoint(InMemoryNetwork(), "server", ledger), ledger)
    yield coord
    coord.store.close()


def test_the_servers_merge_takes_a_predecessors_records_and_its_own_from_the_drain(coordinator):
    coordinator.ledger.record(**dict(FIELDS, msg_id="own-1"))
    coordinator.store_ledger()
    coordinator.ledger.record(**dict(FIELDS, msg_id="own-2"))   # drained by the merge itself
    coordinator.merge_ledgers()
    assert stored_ids(coordinator.run_dir / "run.db") == {"before-resume", "client-1", "own-1", "own-2"}


def test_a_drain_whose_insert_failed_is_recovered_from_the_whole_file(coordinator, monkeypatch):
    coordinator.ledger.record(**dict(FIELDS, msg_id="own-1"))
    real = coordinator.store.insert_records

    def disk_full(records):
        list(records)
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(coordinator.store, "insert_records", disk_full)
    with pytest.raises(sqlite3.OperationalError):
        coordinator.store_ledger()   # "own-1" left the ledger's memory without reaching run.db
    monkeypatch.setattr(coordinator.store, "insert_records", real)
    coordinator.merge_ledgers()
    assert stored_ids(coordinator.run_dir / "run.db") == {"before-resume", "client-1", "own-1"}
