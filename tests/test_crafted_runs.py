"""`fedhop merge-ledgers` and `fedhop report` on crafted run directories (issue 26, item 7):
deeply nested JSON, integers beyond what run.db holds, wrongly typed summary.json and a ledger
line of tens of MB end in a note or a one-line error naming the file (exit 2), never a
traceback, and a huge line is skipped as it streams past, never held in memory."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import pytest

from fedhop.common.records.runstore import RunStore
from fedhop.deploy.tools import ledgers, report


def _record(i: int, **over) -> dict:
    rec = {"run_id": "r", "round": 1, "step": 0, "src": "client-0", "dst": "server", "link": "client-server", "direction": "up",
           "method": "train", "tensor_bytes": 100 + i, "payload_bytes": 110 + i, "framed_bytes": 120 + i,
           "seconds": 0.01, "recorder": "client-0", "role": "sender", "msg_id": f"m{i}", "status": "ok",
           "wall_time": 1.0}
    rec.update(over)
    return rec


def _run_dir(tmp_path: Path, lines: list[str | bytes]) -> Path:
    """A run folder: an empty run.db and ledger/client-0.jsonl holding `lines`."""
    run = tmp_path / "run"
    (run / "ledger").mkdir(parents=True)
    RunStore(run / "run.db").close()
    with open(run / "ledger" / "client-0.jsonl", "wb") as fh:
        for line in lines:
            fh.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return run


def _stored(run: Path) -> set[str]:
    con = sqlite3.connect(run / "run.db")
    try:
        return {r[0] for r in con.execute("SELECT msg_id FROM messages")}
    finally:
        con.close()


CRAFTED = {
    "nested": "[" * 200_000 + "]" * 200_000,
    "nested-field": json.dumps(_record(9))[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "beyond-2^63": json.dumps(_record(9, tensor_bytes=10 ** 30)),
    "round-beyond-2^63": json.dumps(_record(9, round=-(10 ** 20))),
    "5000-digits": json.dumps(_record(9))[:-1] + ', "payload_bytes": ' + "9" * 5000 + "}",
    "infinite": json.dumps(_record(9)).replace('"framed_bytes": 129', '"framed_bytes": Infinity'),
    "wrong-type": json.dumps(_record(9, tensor_bytes={"a": 1})),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_merge_ledgers_skips_a_crafted_line_and_merges_the_rest(tmp_path, capsys, name):
    run = _run_dir(tmp_path, [json.dumps(_record(0)), CRAFTED[name], json.dumps(_record(1))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ledgers.main([str(run)]) == 0
    assert _stored(run) == {"m0", "m1"}
    assert any("client-0.jsonl:2: skipping" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert "2 records added" in capsys.readouterr().out


def test_a_huge_ledger_line_is_skipped_without_being_held_in_memory(tmp_path):
    """One 48 MB line between two records: merge-ledgers' peak Python allocation stays a small
    fraction of it (a readline() would hold the whole line, and its decoded copy)."""
    size = 48 << 20
    run = _run_dir(tmp_path, [json.dumps(_record(0)), b'{"src": "' + b"x" * size + b'"}', json.dumps(_record(1))])
    tracemalloc.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            added, _ = ledgers.merge_run(run)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert added == 2 and _stored(run) == {"m0", "m1"}
    assert peak < size // 8, f"peak {peak} bytes for a {size}-byte line"
    assert any("over" in str(w.message) and ":2:" in str(w.message) for w in caught)


def test_merge_ledgers_into_a_file_that_is_no_database_is_one_line_exit_2(tmp_path):
    run = _run_dir(tmp_path, [json.dumps(_record(0))])
    (run / "run.db").write_bytes(b"not a database at all " * 100)
    res = subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "merge-ledgers", "run"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.count("\n") == 1 and "run.db" in res.stderr and "Traceback" not in res.stderr, res.stderr


GOOD = {"name": "good", "status": "completed", "algorithm": "fedavg", "topology": "star", "transport": "grpc",
        "rounds_completed": 3, "final": {"test_accuracy": 0.9}, "wall_seconds": 1.5,
        "bytes": {"total": {"tensor_bytes": 300, "messages": 3},
                  "by_link": {"client-server": {"tensor_bytes": 300, "messages": 3}}}}

BAD_SUMMARIES = {
    "nested": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "5000-digits": ('{"rounds_completed": ' + "1" * 5000 + "}", "not valid JSON"),
    "rounds-text": (json.dumps({**GOOD, "rounds_completed": "three"}), "rounds_completed"),
    "bytes-text": (json.dumps({**GOOD, "bytes": {"by_link": {"client-server": {"tensor_bytes": "abc"}}}}),
                   "bytes.by_link.client-server.tensor_bytes"),
    "bytes-huge": (json.dumps({**GOOD, "bytes": {"by_link": {"client-server": {"tensor_bytes": 10 ** 400}}}}),
                   "bytes.by_link.client-server.tensor_bytes"),
    "by-link-list": (json.dumps({**GOOD, "bytes": {"by_link": [1, 2]}}), "bytes.by_link"),
    "final-list": (json.dumps({**GOOD, "final": [0.9]}), "final"),
    "name-object": (json.dumps({**GOOD, "name": {"a": 1}}), "name"),
}


@pytest.mark.parametrize("name", sorted(BAD_SUMMARIES))
def test_report_notes_a_crafted_summary_and_reports_the_other_runs(tmp_path, capsys, name):
    text, needle = BAD_SUMMARIES[name]
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    (good / "summary.json").write_text(json.dumps(GOOD))
    (bad / "summary.json").write_text(text)
    status = report.main([str(good), str(bad), "--out", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert status == 0, err
    flat = " ".join(out.split())   # notes are wrapped to the terminal
    at = flat.find(f"note: {bad / 'summary.json'}: ")
    assert at >= 0 and needle in flat[at:at + 300], out
    assert "good" in out and "0.9" in out and "Traceback" not in err


def test_report_on_a_run_db_with_a_crafted_rounds_table(tmp_path, capsys):
    """metrics_json nested too deeply and a round that is text: run.db is noted as unreadable and
    the summary still reports the run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(GOOD))
    RunStore(run / "run.db").close()
    con = sqlite3.connect(run / "run.db")
    cols = [r[1] for r in con.execute("PRAGMA table_info(rounds)")]
    values = {c: None for c in cols}
    values.update({"round": "one", "metrics_json": "[" * 100_000 + "]" * 100_000})
    if "run_id" in values:
        values["run_id"] = "r"
    con.execute(f"INSERT INTO rounds({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                list(values.values()))
    con.commit()
    con.close()
    status = report.main([str(run), "--out", str(tmp_path / "rep"), "--csv", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert status == 0, err
    flat = " ".join(out.split())
    assert f"note: {run / 'run.db'}: unreadable" in flat, out
    assert "good" in out and "0.9" in out
