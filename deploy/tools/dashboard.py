"""The live run page: `fedhop run ... --dashboard [PORT]` and `fedhop dashboard RUN_DIR [--port P]`.

A standard-library HTTP server (a daemon thread) serves one static page, deploy/tools/dashboard.html
(plain HTML, SVG and JavaScript: no front-end build step), and `/api/state`, a JSON snapshot of
the run read from run.db: the topology as a graph (server, edges, client groups) with the bytes
of every link from the live view each process reports with its heartbeats (common/transport/livebytes.py),
the rounds with their metrics and live byte totals, failures and events, and for a private run
(`[privacy]`, docs/privacy.md) epsilon after each round at the config's delta, the `epsilon`
metric of run.db's rounds that the progress line prints.  The page polls the
snapshot every second; the first one is inlined in the page, so the first paint (or a headless
dump) already shows the run.  The page fits a 1000 px wide window; the graph places each link's
byte label where its box overlaps no other text, and lists those it cannot place (many edges)
below the picture.

The server listens on 127.0.0.1 by default: the page shows the run's config and events.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import sqlite3
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fedhop.common.records.runstore import RunStore
from fedhop.common.records.walfold import connect_ro
from fedhop.common.topologies import builtin_specs
from fedhop.common.transport.livebytes import EARLIER
from fedhop.common.util.cliparser import ArgumentParser, port_number
from fedhop.common.util.nodeids import edge_index, edge_node

PAGE = Path(__file__).with_name("dashboard.html")
EVENTS_SHOWN = 30


def _connect(db: Path) -> sqlite3.Connection:
    """Read-only, adding no WAL file to a finished run's folder (the page stays up after the run)."""
    return connect_ro(db, timeout=2.0)


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _config(run_dir: Path) -> dict:
    """The run's config.toml as tables (a key outside any table left out); {} when it cannot be read."""
    try:
        data = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def _is_edge(node: str) -> bool:
    try:
        edge_index(node)
    except ValueError:
        return False
    return True


def _graph(cfg: dict, live: list[tuple], server_pairs: dict[str, dict[str, int]]) -> dict:
    """Nodes (server, edges, client groups) and links with their framed bytes per direction."""
    topo = cfg.get("topology", {})
    kind = topo.get("kind", "star")
    count = int(cfg.get("clients", {}).get("count", 0))
    nodes = [{"id": "server", "label": "server", "tier": 0}]
    links: list[dict] = []

    def live_sum(node: str | None, link: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, lk, direction, _msgs, _t, _p, framed in live:
            if lk == link and (node is None or n.removesuffix(EARLIER) == node):   # a resumed run's carried rows too
                out[direction] = out.get(direction, 0) + int(framed)
        return out

    spec = builtin_specs().get(kind)   # a plug-in kind (not imported here) is drawn as a star
    # edges: the kind always has them, or its runs may (the asynchronous kind's edges) and this
    # run's byte counters name an edge
    live_edge = any(_is_edge(n.removesuffix(EARLIER)) for n, *_ in live)
    if spec is not None and (spec.edges or live_edge):
        edges = int(topo.get("edges", 0)) or len(topo.get("assignment", []) or [])
        for e in range(edges):
            edge = edge_node(e)
            nodes.append({"id": edge, "label": edge, "tier": 1})
            nodes.append({"id": f"clients@{edge}", "label": "clients", "tier": 2})
            links.append({"a": "server", "b": edge, "link": "edge-server", "bytes": server_pairs.get(edge, {})})
            links.append({"a": edge, "b": f"clients@{edge}", "link": "client-edge", "bytes": live_sum(edge, "client-edge")})
            if spec.peer_link == "edge-edge":
                links.append({"a": edge, "b": edge, "link": "edge-edge", "bytes": live_sum(edge, "edge-edge"),
                              "note": spec.peer_note})
    else:
        nodes.append({"id": "clients", "label": f"clients 0-{count - 1}" if count else "clients", "tier": 2})
        links.append({"a": "server", "b": "clients", "link": "client-server", "bytes": live_sum("server", "client-server")})
        if spec is not None and spec.peer_link == "client-client":
            links.append({"a": "clients", "b": "clients", "link": "client-client", "bytes": live_sum(None, "client-client"),
                          "note": spec.peer_note})
    return {"kind": kind, "nodes": nodes, "links": links}


def snapshot(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, from run.db (read-only; the server may be writing) and the run's
    config.toml.  A config.toml whose values are not what fedhop writes (a hand-edited or damaged
    file: a count that is no number, a table that is a string) is left out, not a failed page."""
    run_dir = Path(run_dir)
    try:
        return _snapshot(run_dir, _config(run_dir))
    except (ValueError, TypeError, AttributeError):
        return _snapshot(run_dir, {})


def _snapshot(run_dir: Path, cfg: dict) -> dict[str, Any]:
    state: dict[str, Any] = {"run_dir": str(run_dir), "name": cfg.get("run", {}).get("name", run_dir.name),
                             "algorithm": cfg.get("algorithm", {}).get("name", ""),
                             "topology": cfg.get("topology", {}).get("kind", ""),
                             "rounds_planned": cfg.get("run", {}).get("rounds"), "status": "starting",
                             "rounds": [], "links": [], "events": [], "failures": 0, "graph": _graph(cfg, [], {}),
                             "privacy": _privacy(cfg, [])}
    db = run_dir / "run.db"
    if not db.exists():
        return state
    try:
        con = _connect(db)
        try:
            tables = _tables(con)
            if "runs" in tables:
                row = con.execute("SELECT status FROM runs ORDER BY started DESC LIMIT 1").fetchone()
                state["status"] = row[0] if row else "starting"
            live: list[tuple] = []
            if "live_bytes" in tables:
                live = con.execute("SELECT node, link, direction, messages, tensor_bytes, payload_bytes, framed_bytes "
                                   "FROM live_bytes").fetchall()
            if "rounds" in tables:
                cols = {r[1] for r in con.execute("PRAGMA table_info(rounds)")}
                live_col = "live_framed_bytes" if "live_framed_bytes" in cols else "NULL"
                for rnd, part, sampled, fail, metrics, framed in con.execute(
                        f"SELECT round, participants, sampled, failures, metrics_json, {live_col} FROM rounds ORDER BY round"):
                    state["rounds"].append({"round": rnd, "participants": _count(part), "sampled": _count(sampled),
                                            "failures": _count(fail), "metrics": json.loads(metrics or "{}"),
                                            "bytes": framed})
                state["failures"] = sum(r["failures"] for r in state["rounds"])
            if "events" in tables:
                state["events"] = [{"round": r, "kind": k, "node": n, "detail": d} for r, k, n, d in con.execute(
                    "SELECT round, kind, node, detail FROM events ORDER BY id DESC LIMIT ?", (EVENTS_SHOWN,))]
            pairs: dict[str, dict[str, int]] = {}
            if "messages" in tables:   # the server's own records, per peer: exact per edge while live
                for src, dst, direction, framed in con.execute(
                        "SELECT src, dst, direction, SUM(framed_bytes) FROM messages WHERE recorder = 'server' "
                        "AND link = 'edge-server' GROUP BY src, dst, direction"):
                    peer = dst if src == "server" else src
                    pairs.setdefault(peer, {})[direction] = pairs.get(peer, {}).get(direction, 0) + int(framed)
        finally:
            con.close()
    except (FileNotFoundError, sqlite3.Error) as exc:
        state["error"] = f"run.db: {exc}"
        return state
    by_key: dict[tuple[str, str], list[int]] = {}
    for _node, link, direction, msgs, tensor, payload, framed in live:
        row = by_key.setdefault((link, direction), [0, 0, 0, 0])
        for i, v in enumerate((msgs, tensor, payload, framed)):
            row[i] += int(v)
    state["links"] = [{"link": k[0], "direction": k[1], "messages": v[0], "tensor_bytes": v[1], "payload_bytes": v[2],
                       "framed_bytes": v[3]} for k, v in sorted(by_key.items())]
    state["graph"] = _graph(cfg, live, pairs)
    state["privacy"] = _privacy(cfg, state["rounds"])
    if state["status"] not in ("running", "starting") and state["rounds"]:
        # the run is over: every process's ledger is in run.db, so each round's cumulative bytes come
        # from the messages themselves (the live figures lag a heartbeat); the last round's equal the
        # final table's
        cumulative = _cumulative_framed(run_dir)
        for r in state["rounds"]:
            r["bytes"] = cumulative.get(r["round"], r["bytes"])
        state["rounds"][-1]["bytes"] = sum(row["framed_bytes"] for row in state["links"])
    return state


def _privacy(cfg: dict, rounds: list[dict]) -> dict[str, Any] | None:
    """A private run's epsilon per round (run.db's `epsilon` metric: absent where the run adds no
    noise) with the config's delta and mode; None without [privacy]."""
    p = cfg.get("privacy", {})
    if p.get("mode", "none") == "none":
        return None
    per_round = [[r["round"], r["metrics"]["epsilon"]] for r in rounds if "epsilon" in r["metrics"]]
    return {"mode": p.get("mode"), "delta": p.get("delta"), "epsilon": per_round[-1][1] if per_round else None,
            "per_round": per_round}


def _cumulative_framed(run_dir: Path) -> dict[int, int]:
    """{round: framed bytes of every message up to that round} of a finished run (run.db's messages)."""
    try:
        store = RunStore(run_dir / "run.db", create=False, read_only=True)
    except (FileNotFoundError, sqlite3.Error):
        return {}
    try:
        return {r: int(v["framed_bytes"]) for r, v in store.cumulative_bytes_by_round().items()}
    except sqlite3.Error:
        return {}
    finally:
        store.close()


def _count(value: Any) -> int:
    if isinstance(value, str):
        value = json.loads(value)
    return len(value) if isinstance(value, list) else int(value or 0)


def allowed_host(header: str) -> bool:
    """Whether a request's Host header names this machine: an IP address, `localhost`, or this
    machine's own name.  A page of another site whose name was rebound to 127.0.0.1 (DNS
    rebinding) sends its own name and is refused, so it cannot read the run's state."""
    name = header.strip().lower()
    if name.startswith("["):   # [::1]:8050
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name in {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}


class _Handler(BaseHTTPRequestHandler):
    run_dir: Path

    def do_GET(self) -> None:   # noqa: N802 - the http.server name
        if not allowed_host(self.headers.get("Host", "")):
            self._send(403, "text/plain", b"forbidden: the Host header names another site\n")
            return
        path = self.path.split("?", 1)[0]
        try:
            self._answer(path)
        except Exception as exc:   # a run folder's damaged file never ends the page's server
            print(f"fedhop dashboard: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._send(500, "text/plain", f"the run folder could not be read: {type(exc).__name__}\n".encode())

    def _answer(self, path: str) -> None:
        if path == "/api/state":
            self._send(200, "application/json", json.dumps(snapshot(self.run_dir)).encode())
        elif path in ("/", "/index.html"):
            initial = json.dumps(snapshot(self.run_dir)).replace("</", "<\\/")
            page = PAGE.read_text().replace("/*INITIAL_STATE*/null", initial)
            self._send(200, "text/html; charset=utf-8", page.encode())
        else:
            self._send(404, "text/plain", b"not found\n")

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 - quiet: the run's progress owns stderr
        return


def serve(run_dir: Path, port: int = 0, host: str = "127.0.0.1") -> tuple[ThreadingHTTPServer, str]:
    """Serve the page for `run_dir` from a daemon thread; returns the server and its URL."""
    handler = type("DashboardHandler", (_Handler,), {"run_dir": Path(run_dir)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="dashboard").start()
    return server, f"http://{host}:{server.server_address[1]}/"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="fedhop dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory, finished or running")
    ap.add_argument("--port", type=port_number, default=8050, help="port to serve on (0: any free one; default 8050)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0: every interface)")
    args = ap.parse_args(argv)
    if not args.host.strip():   # "" would listen on every interface, which only 0.0.0.0 may ask for
        ap.error(f"--host {args.host!r}: give an address (127.0.0.1, or 0.0.0.0 for every interface)")
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").exists():
        print(f"fedhop dashboard: {run_dir} holds no config.toml; is it a run directory?", file=sys.stderr)
        return 2
    try:
        server, url = serve(run_dir, args.port, args.host)
    except OSError as exc:
        print(f"fedhop dashboard: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"fedhop dashboard: {url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
