"""`fedhop report` on hand-made run directories (summary.json + run.db written through RunStore)."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from fedhop.common.records.runstore import RunStore
from fedhop.common.wire.ledger import LedgerRecord
from fedhop.deploy.tools.report import build_report, human_bytes, lower_is_better, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def msg(msg_id: str, round_: int, src: str, dst: str, link: str, direction: str, tensor: int, payload: int,
        framed: int, role: str) -> LedgerRecord:
    return LedgerRecord(run_id="r", round=round_, step=0, src=src, dst=dst, link=link, direction=direction,
                        method="train", tensor_bytes=tensor, payload_bytes=payload, framed_bytes=framed,
                        seconds=0.0, recorder=src if role == "sender" else dst, role=role, msg_id=msg_id,
                        status="ok", wall_time=float(round_))


def exchange(msg_id: str, round_: int, child: str, parent: str, link: str, tensor: int = 1000,
             payload: int = 1100, framed: int = 1105) -> list[LedgerRecord]:
    """A down message and its up reply, each recorded by both ends."""
    out = []
    for suffix, src, dst, direction in (("", parent, child, "down"), (".reply", child, parent, "up")):
        for role in ("sender", "receiver"):
            out.append(msg(msg_id + suffix, round_, src, dst, link, direction, tensor, payload, framed, role))
    return out


def write_run(run_dir: Path, *, name: str, algorithm: str, topology: str, metrics: list[dict],
              records: list[LedgerRecord], sim: list[float] | None = None, final: dict | None = None) -> dict:
    run_dir.mkdir(parents=True)
    store = RunStore(run_dir / "run.db")
    store.start_run(f"run-{name}", name=name, algorithm=algorithm, topology=topology, transport="grpc")
    for i, m in enumerate(metrics, start=1):
        store.add_round(i, participants=[0, 1], sampled=[0, 1], failures=[], metrics=m, wall_seconds=0.5,
                        sim_seconds=None if sim is None else sim[i - 1])
    store.insert_records(records)
    by_link = store.bytes_by_link()
    total = by_link.pop("total")
    store.finish_run("completed")
    store.close()
    summary = {"status": "completed", "algorithm": algorithm, "topology": topology, "transport": "grpc",
               "rounds_completed": len(metrics), "final": final or metrics[-1],
               "bytes": {"total": total, "by_link": by_link}, "wall_seconds": 12.5, "num_parameters": 250}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


@pytest.fixture()
def runs(tmp_path):
    # Run A, star: 5 rounds, one server<->client exchange per round (2 messages x 1000 tensor bytes),
    # plus a round-0 registration.  Accuracy first reaches 0.6 at round 3 (then dips: first hit counts).
    acc_a = [0.2, 0.45, 0.61, 0.58, 0.7]
    rec_a = [r for k in range(1, 6) for r in exchange(f"a{k}", k, "client-1", "server", "client-server")]
    rec_a += [msg("reg", 0, "client-1", "server", "control", "control", 0, 50, 55, role)
              for role in ("sender", "receiver")]
    a = write_run(tmp_path / "a", name="fedavg-star", algorithm="fedavg", topology="star",
                  metrics=[{"test_accuracy": v, "test_loss": 1 - v} for v in acc_a], records=rec_a)
    # Run B, hierarchical: 4 rounds, per round one client-edge exchange (500 tensor bytes each way) and
    # one edge-server exchange (1000 each way).  Never reaches 0.6.  Its objective falls below 1.0 at round 4.
    acc_b = [0.1, 0.3, 0.5, 0.55]
    obj_b = [5.0, 3.0, 1.5, 0.9]
    rec_b = []
    for k in range(1, 5):
        rec_b += exchange(f"b{k}e", k, "client-1", "edge-0", "client-edge", tensor=500, payload=560, framed=565)
        rec_b += exchange(f"b{k}s", k, "edge-0", "server", "edge-server")
    b = write_run(tmp_path / "b", name="hier-edges", algorithm="fedavg", topology="hierarchical",
                  metrics=[{"test_accuracy": x, "objective": o} for x, o in zip(acc_b, obj_b)], records=rec_b,
                  sim=[2.0, 2.0, 3.0, 3.0])
    return tmp_path, a, b


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def row_line(table: str, name: str, block: int = 0) -> str:
    """The line of run `name` in the printed table's `block` (0: the runs, 1: to target)."""
    lines = [ln for ln in table.split("\n\n")[block].splitlines() if ln.startswith(name + " ")]
    assert len(lines) == 1, table
    return lines[0]


def test_table_totals_and_rounds_to_target(runs):
    tmp, a, b = runs
    res = build_report([tmp / "a", tmp / "b"], tmp / "out", target=0.6)
    assert res.metric == "test_accuracy"
    ra, rb = res.rows
    # Hand totals.  A: 10 messages x 1000 tensor bytes, framed 10 x 1105 + 55 (registration).
    assert ra.total_bytes == {"tensor_bytes": 10_000, "payload_bytes": 11_050, "framed_bytes": 11_105}
    # B: per round 2 x 500 + 2 x 1000 tensor bytes, 2 x 565 + 2 x 1105 framed; 4 rounds.
    assert rb.total_bytes == {"tensor_bytes": 12_000, "payload_bytes": 13_280, "framed_bytes": 13_360}
    assert rb.by_link == {"client-edge": 4_000, "edge-server": 8_000}
    assert (ra.rounds_to_target, ra.bytes_to_target) == (3, 6_000)  # rounds 1..3: 3 x 2000 tensor bytes
    assert (rb.rounds_to_target, rb.bytes_to_target) == (None, None)
    assert ra.final == 0.7 and rb.final == 0.55 and ra.rounds == 5
    assert ra.ledger == rb.ledger == "agree"

    line_a, line_b = row_line(res.table, "fedavg-star"), row_line(res.table, "hier-edges")
    assert "10.00 kB" in line_a and "star" in line_a and "0.7" in line_a and "12.00 kB" in line_b
    assert "6.00 kB" in row_line(res.table, "fedavg-star", 1) and "kB" not in row_line(res.table, "hier-edges", 1)
    assert any("hier-edges: never reached test_accuracy >= 0.6" in n for n in res.notes)

    md = (tmp / "out" / "report.md").read_text()
    assert "| fedavg-star | - | fedavg | star | 5 |" in md and "| hier-edges |" in md
    assert "client-edge 4.00 kB; edge-server 8.00 kB" in md and "11.11 kB" in md   # the wide details
    raw = json.loads((tmp / "out" / "report.json").read_text())
    assert raw["runs"][0]["bytes_to_target"] == 6_000 and raw["runs"][1]["total_bytes"]["framed_bytes"] == 13_360

    header = res.table.splitlines()[0]  # aligned: every row starts its rounds column where the header does
    col = header.index("rounds")
    assert line_a[col:col + 6].strip() == "5" and line_b[col:col + 6].strip() == "4"


def test_objective_target_means_at_most(runs):
    tmp, _, _ = runs
    assert lower_is_better("objective") and lower_is_better("test_loss") and not lower_is_better("test_accuracy")
    res = build_report([tmp / "b"], tmp / "out-obj", target=1.0, metric="objective")
    (row,) = res.rows
    assert row.rounds_to_target == 4  # 5, 3, 1.5, 0.9: first <= 1.0 at round 4
    assert row.bytes_to_target == 12_000
    res = build_report([tmp / "b"], tmp / "out-obj2", target=2.0, metric="objective")
    assert res.rows[0].rounds_to_target == 3 and res.rows[0].bytes_to_target == 9_000


def test_plots_are_valid_pngs(runs):
    tmp, _, _ = runs
    res = build_report([tmp / "a", tmp / "b"], tmp / "out", target=0.6)
    names = sorted(p.name for p in res.plots)
    assert names == ["bytes_by_link.png", "metric_vs_bytes.png", "metric_vs_download_bytes.png", "metric_vs_round.png",
                     "metric_vs_sim_time.png", "metric_vs_upload_bytes.png"]
    for p in res.plots:
        assert p.parent == tmp / "out" and p.exists()
        assert png_size(p) == (2100, 1350)   # 7 x 4.5 in at 300 dpi (print quality)
        assert p.stat().st_size > 10_000  # a drawn chart, not an empty canvas
    # Without sim_seconds in any run there is no simulated-time plot.
    res = build_report([tmp / "a"], tmp / "out-a")
    assert "metric_vs_sim_time.png" not in [p.name for p in res.plots]


def test_missing_data_gives_notes_not_crashes(runs, tmp_path):
    tmp, a, _ = runs
    only_summary = tmp / "only-summary"
    only_summary.mkdir()
    (only_summary / "summary.json").write_text(json.dumps({**a, "name": "lonely"}))
    no_rounds = tmp / "no-rounds"
    RunStore(no_rounds / "run.db").start_run("x", name="empty-db")
    res = build_report([tmp / "a", only_summary, no_rounds, tmp / "does-not-exist"], tmp / "out-missing",
                       target=0.6)
    assert [r.name for r in res.rows] == ["fedavg-star", "lonely", "empty-db"]
    lonely = res.rows[1]
    assert lonely.total_bytes["tensor_bytes"] == 10_000  # from summary.json alone
    assert lonely.final == 0.7 and lonely.rounds_to_target is None
    assert res.rows[2].total_bytes["tensor_bytes"] is None
    joined = "\n".join(res.notes)
    assert "no run.db" in joined and "run.db has no rounds" in joined and "does-not-exist" in joined
    assert (tmp / "out-missing" / "metric_vs_round.png").exists()


def test_cli_main(runs, capsys):
    tmp, _, _ = runs
    assert main([str(tmp / "a"), str(tmp / "b"), "--out", str(tmp / "cli"), "--target-accuracy", "0.6",
                 "--bytes", "framed"]) == 0
    out = capsys.readouterr().out
    assert "fedavg-star" in out and "hier-edges" in out and "framed bytes to target" in out
    # framed bytes through round 3 of run A: registration 55 + 3 rounds x 2 x 1105 = 6685
    assert human_bytes(6_685) == "6.68 kB" and "6.68 kB" in row_line(out, "fedavg-star", 1)
    assert (tmp / "cli" / "report.md").exists()
    assert main([str(tmp / "nothing-here"), "--out", str(tmp / "cli2")]) == 2   # nothing to report: a bad argument
    assert not (tmp / "cli2").exists()


def test_round_time_breakdown_splits_the_wait():
    """server/coordinator.py `time_breakdown`: compute = the slowest solver, communication = the
    smallest round trip less its own solver time, waiting = the rest of the wait."""
    from fedhop.common.algorithms.base import COMPUTE_KEY, Payload
    from fedhop.server.coordinator import time_breakdown
    t0 = 100.0
    results = {1: Payload(scalars={COMPUTE_KEY: 0.2}), 2: Payload(scalars={COMPUTE_KEY: 0.5}),
               3: Payload(scalars={COMPUTE_KEY: 0.05})}
    arrivals = {1: t0 + 0.3, 2: t0 + 1.0, 3: t0 + 0.4}   # round trips less compute: 0.1, 0.5, 0.35
    parts = time_breakdown(1.0, 0.5, arrivals, t0, results)
    assert parts["time_compute"] == 0.5
    assert abs(parts["time_communication"] - 0.1) < 1e-12
    assert abs(parts["time_waiting"] - 0.4) < 1e-12
    assert abs(sum(parts.values()) - 1.0) < 1e-12
    # without per-client arrivals (hierarchical, torch): the rest of the wait is communication
    assert time_breakdown(1.0, 0.5, {}, t0, {0: Payload()}) == {"time_compute": 0.5, "time_communication": 0.5,
                                                                "time_waiting": 0.0}


def test_tensorboard_event_files_hold_the_runs_scalars(runs):
    """`fedhop report --tensorboard DIR` (deploy/tools/tensorboard.py): read back with TensorBoard's own
    reader, each run's directory holds its metrics per round, the cumulative bytes per round
    (from run.db, independent of the writer) and the simulated clock where the run has one."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tmp, a, b = runs
    assert main([str(tmp / "a"), str(tmp / "b"), "--out", str(tmp / "rep"), "--tensorboard", str(tmp / "tb")]) == 0
    assert sorted(p.name for p in (tmp / "tb").iterdir()) == ["fedavg-star", "hier-edges"]

    def scalars(run: str) -> dict[str, list[tuple[int, float]]]:
        acc = EventAccumulator(str(tmp / "tb" / run))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    sa, sb = scalars("fedavg-star"), scalars("hier-edges")
    assert [s for s, _ in sa["metrics/test_accuracy"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in sa["metrics/test_accuracy"]] == pytest.approx([0.2, 0.45, 0.61, 0.58, 0.7])
    # run A: per round one exchange of 1000 tensor bytes each way, counted once (sender side)
    assert sa["bytes/cumulative_tensor_bytes"] == [(k, 2000.0 * k) for k in range(1, 6)]
    assert "time/sim_seconds" not in sa and [v for _, v in sa["time/round_wall_seconds"]] == [0.5] * 5
    # run B: 2 x 500 client-edge + 2 x 1000 edge-server per round; its virtual clock 2, 2, 3, 3 s
    assert sb["bytes/cumulative_tensor_bytes"] == [(k, 3000.0 * k) for k in range(1, 5)]
    assert sb["time/cumulative_sim_seconds"] == [(1, 2.0), (2, 4.0), (3, 7.0), (4, 10.0)]
    assert [v for _, v in sb["metrics/objective"]] == pytest.approx([5.0, 3.0, 1.5, 0.9])


def test_tensorboard_without_the_package_is_a_clear_error(runs, monkeypatch, capsys):
    import sys
    tmp, _, _ = runs
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # import fails as if not installed
    assert main([str(tmp / "a"), "--out", str(tmp / "rep2"), "--tensorboard", str(tmp / "tb2")]) == 2
    assert "pip install 'fedhop[tensorboard]'" in capsys.readouterr().err
    assert not (tmp / "tb2").exists()


def test_without_matplotlib_no_plot_is_drawn_and_the_caller_is_told(tmp_path, monkeypatch):
    """matplotlib is a dependency (the container image leaves it out): where it cannot be imported,
    make_plots draws nothing and raises, so `fedhop report` exits non-zero (tests/test_report_names.py)."""
    import sys

    from fedhop.deploy.tools.report import PlotsUnavailable, make_plots
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` raises ImportError
    notes: list[str] = []
    with pytest.raises(PlotsUnavailable, match="no png plots: matplotlib cannot be imported"):
        make_plots([], None, None, "wire_bytes", tmp_path, notes)
    assert list(tmp_path.iterdir()) == []


def test_csv_holds_every_run_and_round_with_cumulative_bytes(runs):
    """`--csv DIR` writes DIR/rounds.csv: one row per run and round, the union of the metrics (a
    metric a run lacks is empty), and the bytes of every message up to the round (hand totals)."""
    import csv
    tmp, _, _ = runs
    assert main([str(tmp / "a"), str(tmp / "b"), "--out", str(tmp / "rep"), "--csv", str(tmp / "tables")]) == 0
    with open(tmp / "tables" / "rounds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["run"], int(r["round"])) for r in rows] == \
        [("fedavg-star", k) for k in range(1, 6)] + [("hier-edges", k) for k in range(1, 5)]
    a, b = rows[:5], rows[5:]
    assert [float(r["test_accuracy"]) for r in a] == [0.2, 0.45, 0.61, 0.58, 0.7]
    assert [r["objective"] for r in a] == [""] * 5 and [float(r["objective"]) for r in b] == [5.0, 3.0, 1.5, 0.9]
    assert all((r["participants"], r["sampled"], r["failures"]) == ("2", "2", "0") for r in rows)
    # A: one exchange of 1000 tensor bytes each way per round; framed 2 x 1105 per round + the round-0
    # registration (55).  B: 2 x 500 client-edge + 2 x 1000 edge-server per round, framed 2 x 565 + 2 x 1105.
    assert [int(r["cumulative_tensor_bytes"]) for r in a] == [2000 * k for k in range(1, 6)]
    assert [int(r["cumulative_framed_bytes"]) for r in a] == [55 + 2210 * k for k in range(1, 6)]
    assert [int(r["cumulative_messages"]) for r in a] == [1 + 2 * k for k in range(1, 6)]
    assert [int(r["cumulative_framed_bytes"]) for r in b] == [3340 * k for k in range(1, 5)]
    assert {Path(r["run_dir"]) for r in b} == {(tmp / "b").resolve()}


def test_an_existing_csv_is_refused_before_anything_is_written_unless_force(runs, monkeypatch, capsys):
    """`--csv FILE` follows --out's rule: a file already there is one line, exit 2, with the file and the
    report folder untouched; --force replaces it."""
    tmp, _, _ = runs
    monkeypatch.chdir(tmp)
    Path("mine.csv").write_text("precious")
    Path("tables").mkdir()
    Path("tables/rounds.csv").write_text("precious too")
    assert main(["a", "--out", "rep", "--csv", "mine.csv"]) == 2
    assert capsys.readouterr().err == ("fedhop report: --csv mine.csv: a file is there; name another, or replace it "
                                       "with --force\n")
    assert main(["a", "--out", "rep", "--csv", "tables"]) == 2
    assert capsys.readouterr().err == (f"fedhop report: --csv tables ({Path('tables') / 'rounds.csv'}): a file is "
                                       f"there; name another, or replace it with --force\n")
    assert Path("mine.csv").read_text() == "precious" and Path("tables/rounds.csv").read_text() == "precious too"
    assert not Path("rep").exists()
    assert main(["a", "--out", "rep", "--csv", "mine.csv", "--force"]) == 0
    assert Path("mine.csv").read_text().startswith("run,seed,run_dir,")


def test_a_run_db_that_is_a_folder_is_one_line_and_exit_2(runs, monkeypatch, capsys):
    """run.db a folder (summary.json beside it): said so, not "cannot write None: None"; no report made."""
    tmp, _, _ = runs
    monkeypatch.chdir(tmp)
    Path("a/run.db").unlink()
    Path("a/run.db").mkdir()
    assert main(["a", "--out", "rep"]) == 2
    assert capsys.readouterr().err == "fedhop report: a/run.db: not a file (a run's run.db is an SQLite file)\n"
    assert not Path("rep").exists()


def svg_font_sizes(path: Path) -> list[float]:
    text = path.read_text()
    assert text.count("<text") == len(re.findall(r"font-size: [0-9.]+px", text)) > 0   # every text sized
    return [float(s) for s in re.findall(r"font-size: ([0-9.]+)px", text)]


def test_plots_at_print_quality_in_each_format(runs):
    """PDF and SVG (vector, text kept as text) and PNG at 300 dpi; no text under 9 pt (an SVG's px
    are points: matplotlib writes it at 72 units per inch)."""
    tmp, _, _ = runs
    svg = build_report([tmp / "a", tmp / "b"], tmp / "svg", target=0.6, fmt="svg")
    assert sorted(p.name for p in svg.plots) == ["bytes_by_link.svg", "metric_vs_bytes.svg", "metric_vs_download_bytes.svg",
                                                 "metric_vs_round.svg", "metric_vs_sim_time.svg",
                                                 "metric_vs_upload_bytes.svg"]
    for p in svg.plots:
        assert min(svg_font_sizes(p)) >= 9, p.name
    # the byte axis' ticks in the table's units (run A: 2 to 10 kB; B: 3 to 12 kB), none as 10^4
    ticks = re.findall(r">([^<>]+)</text>", (tmp / "svg" / "metric_vs_bytes.svg").read_text())
    assert "10.00 kB" in ticks and not [t for t in ticks if "10^" in t or "times" in t]
    assert "![metric_vs_round](metric_vs_round.svg)" in (tmp / "svg" / "report.md").read_text()
    pdf = build_report([tmp / "a"], tmp / "pdf", fmt="pdf")
    assert pdf.plots and all(p.suffix == ".pdf" and p.read_bytes()[:5] == b"%PDF-" for p in pdf.plots)
    assert not list((tmp / "pdf").glob("*.png")) and not list((tmp / "svg").glob("*.png"))
    assert main([str(tmp / "a"), "--out", str(tmp / "png150"), "--dpi", "150"]) == 0
    assert png_size(tmp / "png150" / "metric_vs_round.png") == (1050, 675)   # 7 x 4.5 in
    with pytest.raises(SystemExit):
        main([str(tmp / "a"), "--format", "jpeg"])


def test_upload_and_download_curves_count_their_direction_only(runs):
    """The upload and download byte curves (metric_vs_upload_bytes, metric_vs_download_bytes)
    sum the ledger's messages of that direction up to each round, each message once."""
    from fedhop.deploy.tools.report import load_run
    tmp, _, _ = runs
    for name in ("a", "b"):
        run = load_run(tmp / name, [])
        with RunStore(tmp / name / "run.db", create=False) as store:
            rows = [r for r in store.messages() if r["role"] == "sender"]
        rounds = sorted({int(r["round"]) for r in rows})
        assert {r["direction"] for r in rows} >= {"up", "down"}
        for direction in ("up", "down"):
            for rnd in rounds:
                want = sum(r["tensor_bytes"] for r in rows if r["direction"] == direction and r["round"] <= rnd)
                assert run.bytes_upto(rnd, "tensor_bytes", direction) == want
        last = rounds[-1]
        assert (run.bytes_upto(last, "tensor_bytes", "up") + run.bytes_upto(last, "tensor_bytes", "down")
                == run.bytes_upto(last, "tensor_bytes"))


@pytest.mark.parametrize("given, said", [
    (["nosuchdir"], "nosuchdir: no such folder"),
    (["afile"], "afile: a file, not a run folder"),
    (["empty"], "empty: not a run folder (no run.db or summary.json)"),
    (["empty", "nosuchdir"], "empty: not a run folder (no run.db or summary.json) (and none of the other 1"),
])
def test_nothing_to_report_is_one_line_exit_2_and_no_report_folder(tmp_path, monkeypatch, capsys, given, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "empty").mkdir()
    assert main(given) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fedhop report: {said}" or (len(err.splitlines()) == 1 and said in err), err
    assert not (tmp_path / "reports").exists()


def test_a_metric_no_run_recorded_is_one_line_naming_those_recorded(runs, tmp_path, monkeypatch, capsys):
    """`--metric` naming what no run recorded (a misspelling): one line listing the recorded
    metrics, exit 2, and neither the default report folder nor reports/ left behind."""
    tmp, _, _ = runs
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp / "a"), "--metric", "test_acuracy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedhop report: --metric test_acuracy: recorded in none of the runs (recorded: ")
    assert "test_accuracy" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("extra, said", [
    (["--target-accuracy", "-3"], "--target-accuracy -3.0: test_accuracy is a fraction; allowed 0 to 1"),
    (["--target-accuracy", "1.5"], "--target-accuracy 1.5: test_accuracy is a fraction; allowed 0 to 1"),
    (["--target", "nan"], "--target-accuracy nan: not a finite number"),
    (["--metric", "test_loss", "--target", "-0.5"], "--target-accuracy -0.5: test_loss is never negative"),
])
def test_a_target_the_metric_cannot_reach_is_one_line_exit_2_and_no_report_folder(runs, tmp_path, monkeypatch,
                                                                                  capsys, extra, said):
    tmp, _, _ = runs
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp / "a"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedhop report: {said}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "reports").exists()


def test_a_reachable_target_is_reported(runs, tmp_path, monkeypatch, capsys):
    """The bounds are the metric's: 0 and 1 are accuracies a run can reach, a loss target of 0 too."""
    tmp, _, _ = runs
    monkeypatch.chdir(tmp_path)
    for extra in (["--target", "0"], ["--target", "1"], ["--metric", "test_loss", "--target", "0"]):
        assert main([str(tmp / "a"), *extra, "--out", str(tmp_path / f"out{len(extra)}{extra[-1]}")]) == 0


def read_only_mount_works() -> bool:
    """Whether this process may bind-mount a folder read-only in a mount namespace of its own
    (root, or a kernel that lets an unprivileged user namespace do it)."""
    import shutil
    import subprocess
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount --bind / /mnt && mount -o remount,ro,bind /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not read_only_mount_works(), reason="needs `unshare --mount` and a bind mount (root)")
def test_a_run_folder_on_a_read_only_disk_is_reported_whole(runs):
    """A finished run's folder where nothing may be written (an archive on a read-only disk, another
    user's folder): `fedhop report` and `fedhop.load` read its run.db `immutable`, which needs no
    -shm file, so its rounds and bytes are reported as from a writable folder (a read-write
    connection to a WAL database there fails: "unable to open database file")."""
    import subprocess
    import sys
    tmp, _, _ = runs
    (tmp / "ro").mkdir()
    (tmp / "user").mkdir()
    script = ("mount --bind a ro && mount -o remount,ro,bind ro && touch ro/probe 2>/dev/null && exit 3; "
              f"cd user && {sys.executable} -m fedhop.deploy.cli report ../ro --out rep --target-accuracy 0.6 "
              "--bytes framed && "
              f"{sys.executable} -c 'import fedhop; r = fedhop.load(\"../ro\"); print(\"load rounds\", len(r.rounds))'")
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script], cwd=tmp, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unreadable" not in done.stdout + done.stderr, done.stdout + done.stderr
    # framed bytes through round 3 of run A: registration 55 + 3 rounds x 2 x 1105 = 6685
    assert "6.68 kB" in row_line(done.stdout, "fedavg-star", 1), done.stdout
    assert "load rounds 5" in done.stdout
    assert sorted(p.name for p in (tmp / "a").iterdir()) == ["run.db", "summary.json"]
