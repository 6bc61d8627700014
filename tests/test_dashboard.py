"""The live run page (issue 18, item 3): `fedhop run --dashboard` serves a page whose DOM, read by
headless Chromium, shows the run's links with the byte totals of the final table, per link and
direction and per edge, the round and the failures; a screenshot is taken."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.runstore import RunStore
from fedhop.deploy.dashboard import snapshot
from tests.helpers import quadratic_config

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(os.environ.get("FEDHOP_DASHBOARD_PNG", "/tmp/fedhop-dashboard.png"))


class _DataElements(HTMLParser):
    """Every element's tag and data-* attributes, and the text of elements with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict]] = []
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        data = {k[5:]: v for k, v in a.items() if k.startswith("data-")}
        if data:
            self.found.append((tag, data))
        self._open.append(a.get("id"))

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for ident in self._open:
            if ident:
                self.text[ident] = self.text.get(ident, "") + data


def _wait_line(proc, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            line = proc.stderr.readline()
            seen.append(line)
            if needle in line:
                return line
            assert line or proc.poll() is None, "".join(seen)
    raise AssertionError(f"no line with {needle!r} in {timeout:.0f}s: {''.join(seen)}")


def _final_by_edge(store: RunStore, link: str, edge: str) -> int:
    return sum(m["framed_bytes"] for m in store.messages()
               if m["role"] == "sender" and m["link"] == link and edge in (m["src"], m["dst"]))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_dashboard_shows_the_final_tables_bytes_in_headless_chromium(tmp_path):
    rng = np.random.default_rng(2)
    text = quadratic_config(rng.normal(size=(6, 3)), rng.uniform(0.5, 2, size=(6, 3)), [2] * 6, rounds=3,
                            processes=2, topology='kind = "hierarchical"\nedges = 2')
    cfg = tmp_path / "h.toml"
    cfg.write_text(text)
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli", "run", str(cfg), "--out", str(out),
                                 "--quiet", "--dashboard", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        url = _wait_line(launcher, "dashboard at", 180).split("dashboard at", 1)[1].strip()
        _wait_line(launcher, "the run has ended", 300)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1000"]
        shot = tmp_path / "dashboard.png"
        subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
        dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120,
                             check=True).stdout
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
    assert shot.stat().st_size > 10_000   # a rendered page, not an error page
    shutil.copyfile(shot, SCREENSHOT)
    page = _DataElements()
    page.feed(dom)
    store = RunStore(out / "run.db", create=False)
    final = store.bytes_by_link_direction()
    rows = {(d["link"], d["direction"]): int(d["framed"]) for tag, d in page.found if tag == "tr"}
    assert rows == {(link, direction): v["framed_bytes"] for link, per in final.items() for direction, v in per.items()}
    links = {(d["link"], d["a"], d["b"]): int(d["framed"]) for tag, d in page.found if tag == "g" and "link" in d}
    for e in ("edge-0", "edge-1"):   # per edge: the graph's bytes are that edge's messages in the final table
        assert links[("edge-server", "server", e)] == _final_by_edge(store, "edge-server", e)
        assert links[("client-edge", e, f"clients@{e}")] == _final_by_edge(store, "client-edge", e)
    summary = json.loads((out / "summary.json").read_text())
    total = [int(d["framed"]) for tag, d in page.found if tag == "span" and "framed" in d]
    assert total == [summary["bytes"]["total"]["framed_bytes"]]
    assert page.text["round"].strip() == "3" and page.text["failures"].strip() == "0"
    assert page.text["status"].strip() == "completed"
    assert {d["node"] for tag, d in page.found if tag == "g" and "node" in d} == \
        {"server", "edge-0", "edge-1", "clients@edge-0", "clients@edge-1"}
    assert snapshot(out)["rounds"][-1]["bytes"] == summary["bytes"]["total"]["framed_bytes"]
    # a finished run's bytes-axis: each round's cumulative framed bytes from run.db's messages
    per_round = RunStore(out / "run.db", create=False).cumulative_bytes_by_round()
    shown = [r["bytes"] for r in snapshot(out)["rounds"]]
    assert shown[:-1] == [per_round[r]["framed_bytes"] for r in range(1, len(shown))]
    assert shown == sorted(shown) and shown[0] < shown[-1]
