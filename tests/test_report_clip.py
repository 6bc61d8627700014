"""The printed report's table clips long run labels to fit 100 columns (deploy/tools/report.py
render_text); labels that differ must still differ once clipped (issue 45, item 3: three seeds of
one config read `fedavg-digits [fedavg-dig~` three times).  clip_distinct keeps the head and the
part from the first column in which the labels differ, and falls back to a numbered legend."""
from __future__ import annotations

import re

from fedhop.deploy.tools.report import TEXT_WIDTH, build_report, clip_distinct, text_tables
from tests.test_report import exchange, write_run

LONG = "fedavg-digits-a-long-experiment-name-from-a-sweep"


def runs_differing_past_the_head(tmp):
    dirs = []
    for i, (seed, lr) in enumerate([(0, 0.1), (1, 0.1), (2, 0.1), (0, 0.25)]):
        d = tmp / f"{LONG}-seed{seed}-2026112{i}"
        write_run(d, name=LONG, algorithm="fedavg", topology="star", metrics=[{"test_accuracy": 0.5 + 0.1 * i}],
                  records=exchange(f"m{i}", 1, "client-1", "server", "client-server"))
        (d / "config.toml").write_text(f'[run]\nname = "{LONG}"\nseed = {seed}\n'
                                       f'[algorithm]\nname = "fedavg"\nlr = {lr}\n')
        dirs.append(d)
    return dirs


def shown_matches(shown: str, full: str) -> bool:
    """`shown` is `full` with parts left out, each gap marked by one "~" (head~tail, ~middle~)."""
    parts = shown.split("~")
    pattern = ".*".join(re.escape(p) for p in parts)
    return re.fullmatch(pattern if not shown.endswith("~") else pattern + ".*", full) is not None


def test_clipped_labels_of_runs_that_differ_past_the_head_stay_distinct(tmp_path):
    res = build_report(runs_differing_past_the_head(tmp_path), tmp_path / "out")
    names = [r.name for r in res.rows]
    assert len(set(names)) == 4 and all(n.startswith(LONG) for n in names)
    text = text_tables(res.rows, "test_accuracy", None, "framed_bytes")
    lines = text.splitlines()
    assert all(len(line) <= TEXT_WIDTH for line in lines), max(map(len, lines))
    body = lines[2:6]
    width = len(lines[1].split("  ")[0])                 # the run column's dashes
    assert width < len(names[0]), "the labels were not clipped: the test would show nothing"
    shown = [line[:width].rstrip() for line in body]
    # the old clipping (head, then "~") made all four the same text
    assert len({n[:width - 1] + "~" for n in names}) == 1
    assert len(set(shown)) == 4, shown
    for s, full in zip(shown, names):
        assert len(s) <= width and shown_matches(s, full), (s, full)
    # what tells them apart is on screen: the seed of each, and the lr of the last
    assert [re.search(r"=?(\d), lr", s).group(1) for s in shown] == ["0", "1", "2", "0"], shown
    assert "0.25" in shown[3]


def test_labels_too_alike_for_the_column_get_a_numbered_legend():
    cells = ["fedavg-digits seed=0, lr=0.1", "fedavg-digits seed=1, lr=0.1", "fedavg-digits seed=0, lr=0.3",
             "short"]
    legend: list[str] = []
    got = clip_distinct(cells, 8, legend)
    assert len(set(got)) == 4 and all(len(g) <= 8 for g in got) and got[3] == "short"
    keyed = {line.split("  ", 1)[0]: line.split("  ", 1)[1] for line in legend}
    for g, full in zip(got, cells):
        assert keyed.get(g) == full or shown_matches(g, full), (g, full)
    assert set(keyed) <= set(got) and legend                            # every legend key is in the column
    same = ["x" * 20, "x" * 20]                                          # the same label twice stays one text
    assert clip_distinct(same, 8, []) == ["x" * 7 + "~"] * 2
    assert clip_distinct(["abc", "defghijklmnop"], 8, []) == ["abc", "defghij~"]    # nothing alike: the head
