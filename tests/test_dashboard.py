"""The live run page (issue 18, item 3; issue 25, item 7): `fedhop run --dashboard` serves a page
whose DOM, read by headless Chromium, shows the run's links with the byte totals of the final
table, per link and direction and per edge, the round and the failures; a screenshot is taken.
At a 1000 px wide window no two of the page's SVG texts overlap (their getBoundingClientRect, read
by a probe script added to a copy of the page) and nothing overflows sideways, for a real run and
for drawn topologies of up to 40 edges; each registration is one event."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from fedhop.common.records.runstore import RunStore
from fedhop.deploy.tools.dashboard import PAGE, _graph, snapshot
from tests.helpers import quadratic_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = os.environ.get("FEDHOP_DASHBOARD_PNG")   # where to keep a copy of the screenshot, if anywhere
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1000,800"]
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")

# Added to a copy of the page: renders each state of STATES, then records every SVG text's box, the
# pairs of boxes that overlap, and the page's widths, in <pre id="probe"> for --dump-dom to carry.
PROBE = """<script>
(function () {
  const results = [];
  for (const s of (STATES.length ? STATES : [null])) {
    if (s) render(s);
    const boxes = [...document.querySelectorAll("svg text")].map(t => {
      const r = t.getBoundingClientRect();
      return {text: t.textContent, x: r.left, y: r.top, w: r.width, h: r.height};
    }).filter(b => b.w > 0 && b.h > 0);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i], b = boxes[j];
      if (Math.min(a.x + a.w, b.x + b.w) - Math.max(a.x, b.x) > 0.5 &&
          Math.min(a.y + a.h, b.y + b.h) - Math.max(a.y, b.y) > 0.5) overlaps.push([a.text, b.text]);
    }
    const doc = document.documentElement;
    results.push({texts: boxes.length, overlaps, inner_width: window.innerWidth, client_width: doc.clientWidth,
                  scroll_width: doc.scrollWidth,
                  labelled: [...document.querySelectorAll("#graph text.bytes")].map(t => t.dataset.for),
                  legend: [...document.querySelectorAll("#graph-legend li")].map(li => li.dataset.for),
                  links: [...document.querySelectorAll("#graph g.link")].length,
                  events: [...document.querySelectorAll("#events li")].map(li => [li.dataset.kind, li.dataset.node])});
  }
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(results);
  document.body.append(pre);
})();
</script>"""


def _probe(html: str, states: list[dict], folder: Path) -> list[dict]:
    """Render `html` (the page, state inlined or not) in headless Chromium at 1000 x 800 px, then each of
    `states`, and return the probe's measurements, one per state (one for the page as served if none)."""
    page = folder / "probe.html"
    script = PROBE.replace("STATES", json.dumps(states).replace("</", "<\\/"))
    page.write_text(html.replace("</body>", script + "\n</body>"))
    dom = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=180, check=True).stdout
    parser = _DataElements()
    parser.feed(dom)
    return json.loads(parser.text["probe"])


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


@needs_chromium
def test_dashboard_shows_the_final_tables_bytes_in_headless_chromium(tmp_path):
    edges = 5
    rng = np.random.default_rng(2)
    text = quadratic_config(rng.normal(size=(10, 3)), rng.uniform(0.5, 2, size=(10, 3)), [2] * 10, rounds=3,
                            processes=edges, topology=f'kind = "hierarchical"\nedges = {edges}')
    cfg = tmp_path / "h.toml"
    cfg.write_text(text)
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "fedhop.deploy.cli.cli", "run", str(cfg), "--out", str(out),
                                 "--quiet", "--dashboard", "0"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        url = _wait_line(launcher, "dashboard at", 180).split("dashboard at", 1)[1].strip()
        _wait_line(launcher, "the run has ended", 300)
        shot = tmp_path / "dashboard.png"
        subprocess.run([CHROMIUM, *FLAGS, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
        dom = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        with urllib.request.urlopen(url, timeout=30) as reply:
            served = reply.read().decode()
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
    assert shot.stat().st_size > 10_000   # a rendered page, not an error page
    if SCREENSHOT:
        shutil.copyfile(shot, SCREENSHOT)
    page = _DataElements()
    page.feed(dom)
    # at 1000 px: no two texts of the graph and charts overlap, nothing overflows sideways, every
    # link's bytes are on the graph (5 edges fit: no legend)
    [probe] = _probe(served, [], tmp_path)
    assert probe["inner_width"] == 1000 and probe["texts"] >= 4 * edges + 2
    assert probe["overlaps"] == [] and probe["scroll_width"] <= probe["client_width"]
    assert len(probe["labelled"]) == probe["links"] == 2 * edges and probe["legend"] == []
    # each registration is one event: in run.db, and once on the page
    registered = Counter(e["node"] for e in RunStore(out / "run.db", create=False).events("registered"))
    assert registered == Counter({f"edge-{e}": 1 for e in range(edges)})
    assert Counter(node for kind, node in probe["events"] if kind == "registered") == registered
    store = RunStore(out / "run.db", create=False)
    final = store.bytes_by_link_direction()
    rows = {(d["link"], d["direction"]): int(d["framed"]) for tag, d in page.found if tag == "tr"}
    assert rows == {(link, direction): v["framed_bytes"] for link, per in final.items() for direction, v in per.items()}
    links = {(d["link"], d["a"], d["b"]): int(d["framed"]) for tag, d in page.found if tag == "g" and "link" in d}
    for e in (f"edge-{i}" for i in range(edges)):   # per edge: the graph's bytes are that edge's messages in the final table
        assert links[("edge-server", "server", e)] == _final_by_edge(store, "edge-server", e)
        assert links[("client-edge", e, f"clients@{e}")] == _final_by_edge(store, "client-edge", e)
    summary = json.loads((out / "summary.json").read_text())
    total = [int(d["framed"]) for tag, d in page.found if tag == "span" and "framed" in d]
    assert total == [summary["bytes"]["total"]["framed_bytes"]]
    assert page.text["round"].strip() == "3" and page.text["failures"].strip() == "0"
    assert page.text["status"].strip() == "completed"
    assert {d["node"] for tag, d in page.found if tag == "g" and "node" in d} == \
        {"server"} | {f"edge-{i}" for i in range(edges)} | {f"clients@edge-{i}" for i in range(edges)}
    assert snapshot(out)["rounds"][-1]["bytes"] == summary["bytes"]["total"]["framed_bytes"]
    # a finished run's bytes-axis: each round's cumulative framed bytes from run.db's messages
    per_round = RunStore(out / "run.db", create=False).cumulative_bytes_by_round()
    shown = [r["bytes"] for r in snapshot(out)["rounds"]]
    assert shown[:-1] == [per_round[r]["framed_bytes"] for r in range(1, len(shown))]
    assert shown == sorted(shown) and shown[0] < shown[-1]


def _drawn_state(kind: str, edges: int, clients: int = 40) -> dict:
    """A finished run's state as the page gets it, for a topology of `edges` edges, every link carrying
    bytes of a different length (up to hundreds of MB: the widest labels)."""
    cfg = {"topology": {"kind": kind, "edges": edges}, "clients": {"count": clients}}
    live, pairs = [], {}
    for e in range(edges):
        for d, scale in (("down", 10 ** (3 + e % 6)), ("up", 7 * 10 ** (2 + e % 7))):
            live.append((f"edge-{e}", "client-edge", d, 1, 0, 0, 123 * scale + e))
            live.append((f"edge-{e}", "edge-edge", d, 1, 0, 0, 456 * scale))
            pairs.setdefault(f"edge-{e}", {})[d] = 987 * scale
    live += [("server", "client-server", d, 1, 0, 0, 987_654_321) for d in ("down", "up")]
    live += [(f"client-proc{i}", "client-client", "peer", 1, 0, 0, 55_555_555) for i in range(3)]
    rounds = [{"round": r, "participants": 10, "sampled": 10, "failures": 0, "bytes": 1000 * r,
               "metrics": {"test_accuracy": 0.1 * r}} for r in range(1, 6)]
    return {"run_dir": "/a/rather/long/run/directory/" + "x" * 150, "name": f"{kind}-{edges}", "algorithm": "fedavg",
            "topology": kind, "rounds_planned": 5, "status": "completed", "rounds": rounds, "failures": 0,
            "links": [{"link": "client-edge", "direction": "down", "messages": 1, "tensor_bytes": 10 ** 9,
                       "payload_bytes": 10 ** 9, "framed_bytes": 10 ** 9}],
            "events": [{"round": 0, "kind": "registered", "node": f"edge-{e}", "detail": "edge at 127.0.0.1:1 " * 12}
                       for e in range(edges)],
            "graph": _graph(cfg, live, pairs)}


@needs_chromium
def test_dashboard_labels_never_overlap_and_the_page_fits_1000_px(tmp_path):
    """Stars, chains, hierarchies and Fed-CHS rings of 1 to 40 edges at a 1000 px wide window: no two
    texts overlap, nothing overflows sideways, and each link's bytes are on the graph or, where no
    position is free, in the legend below it; up to 8 edges, all of them are on the graph."""
    cases = [("star", 0), ("chain", 0)] + [(k, n) for k in ("hierarchical", "sequential") for n in (1, 3, 5, 8, 16, 40)]
    states = [_drawn_state(kind, n) for kind, n in cases]
    results = _probe(PAGE.read_text(), states, tmp_path)
    assert len(results) == len(cases)
    for (kind, n), state, r in zip(cases, states, results):
        case = f"{kind} with {n} edges"
        assert r["inner_width"] == 1000, case
        assert r["overlaps"] == [], (case, r["overlaps"][:5])
        assert r["scroll_width"] <= r["client_width"], (case, r["scroll_width"])
        expected = Counter(f"{lk['a']}|{lk['b']}|{lk['link']}" for lk in state["graph"]["links"])
        assert r["links"] == sum(expected.values()), case
        assert Counter(r["labelled"]) + Counter(r["legend"]) == expected, case   # each link once, somewhere
        if n <= 8:
            assert r["legend"] == [], case
        # nodes: one text each; links: one label or marker each (at most); the link names
        assert r["texts"] >= len(state["graph"]["nodes"]) + len(r["labelled"]), case


def test_the_page_refuses_a_host_header_of_another_site(tmp_path):
    """DNS rebinding: a page of evil.example whose name resolves to 127.0.0.1 reaches the server
    with `Host: evil.example:PORT` and is refused (403); this machine's names and IPs are served."""
    import http.client
    import socket

    from fedhop.deploy.tools.dashboard import allowed_host, serve
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('[run]\nname = "hosts"\n')
    server, url = serve(run, 0)
    port = server.server_address[1]
    try:
        def status(host: str) -> int:
            con = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                con.putrequest("GET", "/api/state", skip_host=True)
                con.putheader("Host", host)
                con.endheaders()
                return con.getresponse().status
            finally:
                con.close()
        assert status(f"evil.example:{port}") == 403
        assert status(f"localhost.evil.example:{port}") == 403
        assert status(f"127.0.0.1:{port}") != 403 and status(f"localhost:{port}") != 403
        assert status(f"[::1]:{port}") != 403
    finally:
        server.shutdown()
    assert allowed_host(socket.gethostname()) and allowed_host("10.1.2.3:80") and not allowed_host("")


@pytest.mark.parametrize("config", [b"\xff\xfe garbage [[[", b'[clients]\ncount = "abc"\n', b"clients = 5\n",
                                    b'[topology]\nkind = "hierarchical"\nedges = "many"\n', b"[run]\nname = 5\n"])
def test_a_damaged_config_toml_still_serves_the_page_from_run_db(tmp_path, config):
    """A run folder's config.toml that is not what fedhop writes (not UTF-8, a count that is no
    number, a table that is a value) never fails a request: the page and /api/state answer 200 with
    run.db's rounds, the config's facts left out; the server goes on serving."""
    import http.client

    from fedhop.deploy.tools.dashboard import serve
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_bytes(config)
    store = RunStore(run / "run.db")
    store.start_run(run_id="r1", name="damaged", algorithm="fedavg", topology="star", transport="grpc", config_toml="")
    store.close()
    server, _url = serve(run, 0)
    port = server.server_address[1]
    try:
        for path in ("/api/state", "/", "/api/state"):
            con = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                con.request("GET", path)
                reply = con.getresponse()
                body = reply.read()
            finally:
                con.close()
            assert reply.status == 200, (path, body[:300])
        assert json.loads(body)["status"] == "running"
    finally:
        server.shutdown()


def test_an_empty_host_is_refused_not_every_interface(tmp_path, capsys):
    from fedhop.deploy.tools.dashboard import main as dashboard
    (tmp_path / "config.toml").write_text("[run]\n")
    with pytest.raises(SystemExit) as exit_:
        dashboard([str(tmp_path), "--host", "", "--port", "0"])
    assert exit_.value.code == 2 and "--host '': give an address" in capsys.readouterr().err
