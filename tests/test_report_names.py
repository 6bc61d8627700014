"""`fedhop report` tells runs apart (issue 45, item 3): runs of one config name are labelled by the
config keys in which they differ (the seed first), in the printed table, report.md, the CSV and the
plot legends; a seed column in the table and the CSV; report.md links the CSV by a path that works
from report.md's folder; a requested plot format that cannot be made is a non-zero exit."""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

from fedhop.deploy.tools.report import build_report, main
from tests.test_report import exchange, write_run


def three_seeds_and_an_lr(tmp: Path) -> list[Path]:
    dirs = []
    for i, (seed, lr) in enumerate([(0, 0.1), (1, 0.1), (2, 0.1), (0, 0.3)]):
        d = tmp / f"fedavg-digits-2026112{i}"
        write_run(d, name="fedavg-digits", algorithm="fedavg", topology="star",
                  metrics=[{"test_accuracy": 0.5 + 0.1 * i}], records=exchange(f"m{i}", 1, "client-1", "server",
                                                                             "client-server"))
        (d / "config.toml").write_text(f'[run]\nname = "fedavg-digits"\nseed = {seed}\n'
                                       f'[algorithm]\nname = "fedavg"\nlr = {lr}\n[data]\ndata_dir = "/d"\n')
        dirs.append(d)
    return dirs


def test_runs_of_one_name_are_labelled_by_what_differs(tmp_path):
    dirs = three_seeds_and_an_lr(tmp_path)
    res = build_report(dirs, tmp_path / "out", csv_out=tmp_path / "out" / "rounds.csv")
    names = [r.name for r in res.rows]
    assert names == ["fedavg-digits seed=0, lr=0.1", "fedavg-digits seed=1, lr=0.1",
                     "fedavg-digits seed=2, lr=0.1", "fedavg-digits seed=0, lr=0.3"]
    assert [r.seed for r in res.rows] == [0, 1, 2, 0]
    md = res.markdown
    assert "| run | seed |" in md and all(n in md for n in names)
    with open(tmp_path / "out" / "rounds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["run"], r["seed"]) for r in rows if r["round"] == "1"] == [(n, str(s)) for n, s in
                                                                          zip(names, [0, 1, 2, 0])]
    link = re.search(r"\[rounds\.csv\]\(([^)]+)\)", md).group(1)
    assert (tmp_path / "out" / link).resolve() == (tmp_path / "out" / "rounds.csv").resolve()
    legend = (tmp_path / "out" / "metric_vs_round.png").exists()
    assert legend


def test_the_same_config_twice_falls_back_to_the_folder(tmp_path):
    dirs = three_seeds_and_an_lr(tmp_path)[:2]
    (dirs[1] / "config.toml").write_text((dirs[0] / "config.toml").read_text())
    res = build_report(dirs, tmp_path / "out")
    assert [r.name for r in res.rows] == [f"fedavg-digits [{dirs[0].name}]", f"fedavg-digits [{dirs[1].name}]"]


def test_a_csv_elsewhere_is_linked_relative_to_report_md(tmp_path):
    dirs = three_seeds_and_an_lr(tmp_path)[:1]
    res = build_report(dirs, tmp_path / "reports" / "r1", csv_out=tmp_path / "tables" / "all.csv")
    link = re.search(r"\[all\.csv\]\(([^)]+)\)", res.markdown).group(1)
    assert link == "../../tables/all.csv"
    assert (tmp_path / "reports" / "r1" / link).resolve() == (tmp_path / "tables" / "all.csv").resolve()


def test_plots_that_cannot_be_made_are_a_non_zero_exit(tmp_path, monkeypatch, capsys):
    """matplotlib made unimportable (a broken install): the table and report.md are still written,
    the missing PDFs are said on stderr, and the exit status is 1."""
    dirs = three_seeds_and_an_lr(tmp_path)[:2]
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # import matplotlib raises ImportError
    code = main([*map(str, dirs), "--format", "pdf", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "no pdf plots: matplotlib cannot be imported" in err
    assert (tmp_path / "out" / "report.md").exists() and not list((tmp_path / "out").glob("*.pdf"))
