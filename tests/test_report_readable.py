"""Reports a reader can trust (issue 18, item 4): the default output goes beside the runs, every
plot names the runs it leaves out and why, byte axes use the table's units, and the progress line,
the report and the live page write bytes in one unit style."""
from __future__ import annotations

import re
from pathlib import Path

from fedhop.deploy.launch import launcher
from fedhop.deploy.tools import report
from fedhop.deploy.tools.report import build_report, default_out, human_bytes, main
from tests.test_report import exchange, runs, write_run  # noqa: F401 - the fixture, and its run writer

ROOT = Path(__file__).resolve().parents[1]


def test_default_output_is_a_new_folder_outside_runs(runs, tmp_path, monkeypatch):
    """Issue 45, item 3: the default report folder is reports/report-TIMESTAMP in the working
    directory (a `runs/*` glob never sees it), a new one each time; an --out holding an earlier
    report is refused unless --force."""
    tmp, _, _ = runs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(tmp / "a"), str(tmp / "b")]) == 0
    assert main([str(tmp / "a"), str(tmp / "b")]) == 0
    made = sorted((elsewhere / "reports").iterdir())
    assert len(made) == 2 and all((d / "report.md").exists() for d in made)
    assert all(d.name.startswith("report-") for d in made) and not (tmp / "report").exists()
    assert default_out(tmp_path) != default_out(tmp_path)          # never the same folder
    assert main([str(tmp / "a"), "--out", "mine"]) == 0
    before = (elsewhere / "mine" / "report.md").read_text()
    assert main([str(tmp / "a"), str(tmp / "b"), "--out", "mine"]) == 2
    assert (elsewhere / "mine" / "report.md").read_text() == before
    assert main([str(tmp / "a"), str(tmp / "b"), "--out", "mine", "--force"]) == 0
    assert (elsewhere / "mine" / "report.md").read_text() != before


def test_plots_name_the_runs_they_leave_out(runs, tmp_path):
    tmp, _, _ = runs
    write_run(tmp / "timed", name="timed-star", algorithm="fedavg", topology="star",
              metrics=[{"test_accuracy": 0.3, "time_compute": 0.1, "time_communication": 0.2, "time_waiting": 0.0,
                        "time_aggregation": 0.01, "time_evaluation": 0.01}],
              records=exchange("t1", 1, "client-1", "server", "client-server"), sim=[1.5])
    res = build_report([tmp / "a", tmp / "b", tmp / "timed"], tmp / "out")
    notes = "\n".join(res.notes)
    assert "metric_vs_sim_time.png: fedavg-star left out (its star rounds record no simulated time)" in notes
    assert "round_time_breakdown.png: fedavg-star left out (its star rounds record no time breakdown)" in notes
    assert "round_time_breakdown.png: hier-edges left out (its hierarchical rounds record no time breakdown)" in notes
    assert (tmp / "out" / "metric_vs_sim_time.png").exists() and (tmp / "out" / "round_time_breakdown.png").exists()


def test_one_unit_style_and_no_offset_notation():
    assert launcher.human_bytes is report.human_bytes   # the progress line and the report share one
    assert human_bytes(173_000) == "173.00 kB" and human_bytes(28_790_000) == "28.79 MB"
    assert report._bytes_formatter()(1e7, 0) == "10.00 MB"
    page = (ROOT / "deploy" / "tools" / "dashboard.html").read_text()
    assert '["B", "kB", "MB", "GB", "TB"]' in page and '"KB"' not in page


def test_printed_report_of_real_runs_fits_100_columns(tmp_path, capsys):
    """Real runs of three topologies (up to four links each), long run names and a target: every
    printed line fits 100 columns; the per-link details and the full names are in report.md."""
    import numpy as np

    from fedhop.deploy.launch.launcher import run_local
    from tests.helpers import quadratic_config

    rng = np.random.default_rng(1)
    centers, curv = rng.normal(0, 2, size=(6, 3)), rng.uniform(0.5, 2.0, size=(6, 3))
    topologies = {"star": 'kind = "star"', "hierarchical": 'kind = "hierarchical"\nedges = 2',
                  "sequential": 'kind = "sequential"\nedges = 2\ngraph = "ring"\nsteps_per_round = 2\nstart = 0'}
    dirs = []
    for kind, topology in topologies.items():
        name = f"{kind}-quadratic-six-clients-with-a-long-descriptive-name"
        text = quadratic_config(centers, curv, [5, 9, 13, 3, 7, 11], rounds=3, per_round=4, local_steps=2,
                                topology=topology, algorithm="fedchs" if kind == "sequential" else "fedavg", name=name)
        (tmp_path / f"{kind}.toml").write_text(text)
        dirs.append(tmp_path / kind)
        assert run_local(str(tmp_path / f"{kind}.toml"), [], str(dirs[-1]), quiet=True) == 0
    capsys.readouterr()
    assert main([str(d) for d in dirs] + ["--target", "100", "--metric", "objective", "--bytes", "framed",
                                          "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    runs_block, target_block = out.split("\n\n")[:2]
    assert runs_block.splitlines()[0].split()[:5] == ["run", "seed", "algorithm", "topology", "rounds"]
    assert len(runs_block.splitlines()) == 2 + 3 and target_block.splitlines()[0].split()[:2] == ["run", "rounds"]
    assert re.search(r"sequential-quadrati~ +0 +fedchs +sequential", runs_block)   # the long name clipped
    md = (tmp_path / "report" / "report.md").read_text()
    assert "edge-edge" in md and "client-edge" in md and "edge-server" in md   # bytes per link, in full
    assert all(f"{kind}-quadratic-six-clients-with-a-long-descriptive-name" in md for kind in topologies)
    assert max(len(line) for line in md.splitlines()) > 100   # the details that did not fit are there
