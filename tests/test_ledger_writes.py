"""benchmarks/ledger_writes.py (issue 49): its tiny run prints and writes a figure for every
ledger kind and thread count, and its check that the file holds every record once can fail."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = runpy.run_path(str(ROOT / "benchmarks" / "ledger_writes.py"), run_name="ledger_writes")


def test_the_tiny_run_prints_every_cell(tmp_path, capsys):
    assert BENCH["main"](["--records", "640", "--threads", "1,3", "--passes", "1", "--json", str(tmp_path / "o.json")]) == 0
    out = json.loads((tmp_path / "o.json").read_text())
    assert [(r["hold"], r["threads"]) for r in out["rows"]] == [(True, 1), (True, 3), (False, 1), (False, 3)]
    assert all(r[k] > 0 for r in out["rows"] for k in ("each_wall_us", "each_cpu_us", "deferred_wall_us"))
    assert out["new_msg_id_us"] > 0 and out["uuid4_hex_us"] > 0
    assert "a write a group" in capsys.readouterr().out


def test_a_file_that_lost_a_record_fails_the_pass():
    """A ledger that drops one record's line: the pass's check of the file must catch it."""
    records = [BENCH["record"](i) for i in range(40)]
    ledger_type = BENCH["Ledger"]
    original = ledger_type.add

    def add(self, record):
        if record.msg_id != records[16].msg_id:
            original(self, record)

    ledger_type.add = add
    try:
        with pytest.raises(RuntimeError, match="holds 39 records, 39 distinct, of 40"):
            BENCH["one_pass"](records, 2, 8, True, True)
    finally:
        ledger_type.add = original
    assert BENCH["one_pass"](records, 2, 8, True, True)[0] > 0
