"""What a child refuses reaches the server's run.db (issue 26: the parent is told).

- A client or edge process that registered and then refuses the run's config (PLUGIN_NOT_ALLOWED:
  a plug-in it was not started with) tells its parent before it exits 2; the server records a
  `config_refused` event naming the process and the plug-in and fails the run at once, with that
  reason, instead of waiting out its registration or round timeouts (server/child_reports.py).
- An edge's refused registrations are events at the server, carried by its heartbeats
  (edge/reports.py).

Real server, edge and client processes on loopback, started as compose or Slurm starts them."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhop.common.transport.grpc import GrpcEndpoint
from fedhop.common.util import plugins
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import Ledger

PLUGIN = '''
import torch
def make_net(input_shape, n_outputs, **kw):
    return torch.nn.Linear(input_shape[0], n_outputs)
'''
CONFIG = """
[run]
name = "refusals"
rounds = {rounds}
seed = 0
[topology]
kind = "{kind}"
{edges}
[algorithm]
name = "fedavg"
lr = 0.1
local_epochs = 1
batch_size = 32
[data]
dataset = "digits"
[model]
factory = "refpkg:make_net"
[clients]
count = 4
per_round = 4
[security]
heartbeat_interval = 0.5
"""
REGISTER_TIMEOUT = "600"      # a run that waited for it would outlast every wait below


class Run:
    """The processes of one run, started by hand; killed at the end whatever happened."""

    def __init__(self, tmp: Path, kind: str, rounds: int) -> None:
        self.tmp = tmp
        (tmp / "plugins" / "refpkg").mkdir(parents=True)
        (tmp / "plugins" / "refpkg" / "__init__.py").write_text(PLUGIN)
        (tmp / "exp.toml").write_text(CONFIG.format(kind=kind, rounds=rounds,
                                                    edges="edges = 1" if kind == "hierarchical" else ""))
        self.run_dir = tmp / "run"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("FEDHOP_TOKEN", plugins.ALLOW_ENV, "FEDHOP_NODE_CRED")}
        self.env[plugins.PLUGIN_PATH_ENV] = str(tmp / "plugins")
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, role: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", f"fedhop.{role}", *args], cwd=self.tmp,
                                            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self.procs[name]

    def server(self) -> str:
        self.start("server", "server", "--config", "exp.toml", "--run-dir", "run", "--port-file", "server.address",
                   "--register-timeout", REGISTER_TIMEOUT)
        return str(self.tmp / "server.address")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def events(self, kind: str) -> list[tuple[str, str]]:
        db = self.run_dir / "run.db"
        if not db.exists():
            return []
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
                return con.execute("SELECT node, detail FROM events WHERE kind = ?", (kind,)).fetchall()
        except sqlite3.OperationalError:   # the table is not made yet
            return []

    def wait_for(self, what, timeout: float = 240.0, name: str = "server"):
        deadline = time.monotonic() + timeout
        while True:
            got = what()
            if got:
                return got
            assert time.monotonic() < deadline and self.procs[name].poll() is None, self.log(name)[-3000:]
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def run_factory(tmp_path):
    runs: list[Run] = []

    def make(kind: str, rounds: int = 2) -> Run:
        runs.append(Run(tmp_path, kind, rounds))
        return runs[-1]
    yield make
    for r in runs:
        r.close()


def check_failed_for(run: Run, refuser: str) -> None:
    """The server exited 1 with the refusal as the run's reason, the refuser 2."""
    assert run.procs["server"].wait(timeout=240) == 1, run.log("server")[-3000:]
    assert run.procs[refuser].wait(timeout=60) == 2, run.log(refuser)[-3000:]
    (event,) = run.events("config_refused")
    assert event[0] == refuser and "PLUGIN_NOT_ALLOWED" in event[1] and "refpkg:make_net" in event[1], event
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and refuser in summary["error"] and "PLUGIN_NOT_ALLOWED" in summary["error"]
    assert summary["rounds_completed"] < 2
    failed = run.events("run_failed")
    assert len(failed) == 1 and "refpkg:make_net" in failed[0][1]


def test_a_client_refusing_the_config_fails_the_run_at_once_with_its_reason(run_factory):
    run = run_factory("star")
    server = run.server()
    run.start("client-proc0", "client", "--parent-file", server, "--clients", "0-1", "--node-id", "client-proc0",
              "--allow-plugin", "refpkg")
    run.start("client-proc1", "client", "--parent-file", server, "--clients", "2-3", "--node-id", "client-proc1")
    check_failed_for(run, "client-proc1")


@pytest.mark.slow
def test_a_client_under_an_edge_refusing_the_config_is_passed_on_by_the_edge(run_factory):
    run = run_factory("hierarchical")
    server = run.server()
    run.start("edge-0", "edge", "--parent-file", server, "--node-id", "edge-0", "--port-file", "edge-0.address",
              "--allow-plugin", "refpkg")
    edge = str(run.tmp / "edge-0.address")
    run.start("client-proc0", "client", "--parent-file", edge, "--clients", "0-1", "--node-id", "client-proc0",
              "--allow-plugin", "refpkg")
    run.start("client-proc1", "client", "--parent-file", edge, "--clients", "2-3", "--node-id", "client-proc1")
    check_failed_for(run, "client-proc1")
    assert "(via edge-0)" in run.events("config_refused")[0][1]


def test_an_edges_refused_registrations_are_events_at_the_server(run_factory):
    """A registration the edge refuses (a client outside its cluster) becomes a register_refused
    event in the server's run.db, naming the edge; then SIGTERM ends the run as stopped."""
    run = run_factory("hierarchical", rounds=100000)
    server = run.server()
    run.start("edge-0", "edge", "--parent-file", server, "--node-id", "edge-0", "--port-file", "edge-0.address",
              "--allow-plugin", "refpkg")
    edge_file = run.tmp / "edge-0.address"
    run.start("client-proc0", "client", "--parent-file", str(edge_file), "--clients", "0-3",
              "--node-id", "client-proc0", "--allow-plugin", "refpkg")
    run.wait_for(lambda: run.events("registration_complete"))
    assert run.events("register_refused") == []
    intruder = GrpcEndpoint("intruder", Ledger())
    try:
        reply = intruder.register(edge_file.read_text().strip(), pb.RegisterRequest(
            node_id="client-proc9", role="client", address="127.0.0.1:1", clients=[pb.LogicalClient(client_id=99)]),
            timeout=30.0)
    finally:
        intruder.stop(grace=0.1)
    assert not reply.accepted
    (event,) = run.wait_for(lambda: run.events("register_refused"))
    assert event[0] == "client-proc9" and event[1].startswith("at edge-0: ") and reply.message in event[1], event
    run.procs["server"].send_signal(signal.SIGTERM)
    assert run.procs["server"].wait(timeout=120) == 128 + signal.SIGTERM, run.log("server")[-3000:]
    assert json.loads((run.run_dir / "summary.json").read_text())["status"] == "stopped"


def rounds_recorded(run: Run) -> int:
    db = run.run_dir / "run.db"
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
            return int(con.execute("SELECT COUNT(*) FROM rounds WHERE round > 0").fetchone()[0])
    except sqlite3.OperationalError:   # not made yet
        return 0


# a client process with valid credentials that attacks from round 2 on: the real client, its train
# handler wrapped to send (once, from its own endpoint and registration) a refusal blaming another
# node, and a heartbeat with forged events and byte counts past what run.db holds
EVIL_CLIENT = """
import sys, threading, time
from fedhop.client import host, runtime
from fedhop.common.util.plugins import tell_refusal
from fedhop.common.util.procexit import exit_now
from fedhop.common.wire import fedhop_pb2 as pb
procs, sent = [], []
init, train = runtime.ClientProcess.__init__, host.ClientHost.train
def keep(self, *a, **k):
    init(self, *a, **k)
    procs.append(self)
def attack():
    p = procs[0]
    tell_refusal(p.endpoint, p.parent, p._request(), p.endpoint.run_id,
                 "client-proc0: PLUGIN_NOT_ALLOWED: forged\\n\\x1b[31m by a participant")
    forged = [pb.NodeEvent(kind="node_dead", node="server", detail="forged"),
              pb.NodeEvent(kind="config_refused", node="client-proc0", detail="forged"),
              pb.NodeEvent(kind="auth_refused", node="client-proc0", detail="forged\\n\\x1b[31m")]
    huge = pb.LinkBytes(node_id=p.endpoint.node_id, link="client-server", direction="sent", messages=2 ** 64 - 1,
                        tensor_bytes=2 ** 63, payload_bytes=2 ** 63, framed_bytes=2 ** 64 - 1)
    p.endpoint.heartbeat(p.parent, pb.HeartbeatRequest(node_id=p.endpoint.node_id, run_id=p.endpoint.run_id,
                         seq=10 ** 6, sent_at=time.time(), events=forged, bytes=[huge]), 30.0)
    print("ATTACKED", flush=True)
def evil_train(self, cid, round, message, step=0):
    if round >= 2 and not sent:
        sent.append(round)
        threading.Thread(target=attack).start()
    return train(self, cid, round, message, step)
runtime.ClientProcess.__init__, host.ClientHost.train = keep, evil_train
from fedhop.client.__main__ import main
exit_now(main(sys.argv[1:]))
"""


def test_a_participant_cannot_end_a_run_under_way_or_forge_its_records(run_factory):
    """After the run's first round a registered client's refusal is recorded under its own name and
    the run goes on (red team: one Register with `refusal` set failed any run at any round, its text
    blaming another node); a client process's heartbeat events (a forged `node_dead` of the server, a
    `config_refused` of another client, text with a newline and a terminal escape) are not recorded,
    and byte totals past 2^63 - 1 are ignored, not a traceback; a refused caller's node id is
    recorded as one printable line."""
    run = run_factory("star", rounds=100000)
    server = run.server()
    run.start("client-proc0", "client", "--parent-file", server, "--clients", "0-1", "--node-id", "client-proc0",
              "--allow-plugin", "refpkg")
    (run.tmp / "evil_client.py").write_text(EVIL_CLIENT)
    with open(run.tmp / "client-proc1.log", "w") as log:
        run.procs["client-proc1"] = subprocess.Popen(
            [sys.executable, "evil_client.py", "--parent-file", server, "--clients", "2-3", "--node-id",
             "client-proc1", "--allow-plugin", "refpkg"], cwd=run.tmp, env=run.env, stdout=log, stderr=subprocess.STDOUT)
    run.wait_for(lambda: "ATTACKED" in run.log("client-proc1"), name="client-proc1")
    (event,) = run.wait_for(lambda: run.events("config_refused"))
    assert event[0] == "client-proc1" and event[1].startswith("client-proc1: client-proc0: PLUGIN_NOT_ALLOWED"), event
    assert "\n" not in event[1] and "\x1b" not in event[1], event
    before = rounds_recorded(run)
    run.wait_for(lambda: rounds_recorded(run) >= before + 2)   # the run goes on
    assert run.wait_for(lambda: "counts past 2^63 - 1" in run.log("server"))
    assert run.events("node_dead") == [] and run.events("auth_refused") == [], run.events("auth_refused")
    assert "Traceback" not in run.log("server") and "OverflowError" not in run.log("server")
    # a caller's node id (anything without credentials) enters run.db as one printable line of <= 200
    intruder = GrpcEndpoint("intruder", Ledger())
    try:
        reply = intruder.register(Path(server).read_text().strip(), pb.RegisterRequest(
            node_id="evil\n\x1b[2J" + "x" * 5000, role="client", address="127.0.0.1:1",
            clients=[pb.LogicalClient(client_id=99)]), timeout=30.0)
    finally:
        intruder.stop(grace=0.1)
    assert not reply.accepted
    ((node, detail),) = run.wait_for(lambda: run.events("register_refused"))
    assert node == "evil ?[2J" + "x" * 191 and "\n" not in detail and len(detail) <= 2000, (node, detail)
    run.procs["server"].send_signal(signal.SIGTERM)
    assert run.procs["server"].wait(timeout=120) == 128 + signal.SIGTERM, run.log("server")[-3000:]
    assert json.loads((run.run_dir / "summary.json").read_text())["status"] == "stopped"


def test_only_an_edges_refusal_events_are_recorded_each_as_one_printable_line():
    """ChildReports.events (unit): an edge's refusal kinds are recorded, prefixed with the edge;
    another kind from the edge (a forged node_dead) and anything from a client process are not;
    a newline or terminal escape in the node or detail becomes a space or '?'."""
    from types import SimpleNamespace

    from fedhop.server.child_reports import ChildReports
    from fedhop.server.driver import ChildNode
    recorded: list[tuple] = []
    coord = SimpleNamespace(children={"edge-0": ChildNode("edge-0", "edge", "a:1", []),
                                      "client-proc0": ChildNode("client-proc0", "client", "a:2", [0])},
                            store=SimpleNamespace(add_event=lambda kind, **kw: recorded.append((kind, kw["node"],
                                                                                                kw["detail"]))),
                            rounds_completed=3, round_writers=[], round_gates=[])
    reports = ChildReports(coord)
    events = [pb.NodeEvent(kind="auth_refused", node="10.0.0.9\x1b[2J", detail="bad token\nsecond line"),
              pb.NodeEvent(kind="node_dead", node="server", detail="forged"),
              pb.NodeEvent(kind="events_dropped", node="", detail="3 more")]
    reports.events("client-proc0", events)
    assert recorded == []
    reports.events("edge-0", events)
    assert recorded == [("auth_refused", "10.0.0.9?[2J", "at edge-0: bad token second line"),
                        ("events_dropped", "edge-0", "at edge-0: 3 more")]


@pytest.mark.parametrize("registered", ["every client", "one of two client processes"])
def test_a_refusal_whose_signal_exception_was_lost_still_fails_the_run_before_its_first_round(tmp_path, registered):
    """A signal handler's exception raised while the main thread runs a callback from C code (a
    weakref callback inside an import) is printed and dropped: the server once played every round
    after a client's set-up refusal (CI, one run in thousands).  The coordinator asks ChildReports
    before each round (`raise_pending`); here no SIGUSR1 handler is installed at all, so that check
    alone must fail the run, with the refusal as its reason and no round played: before round 1, or
    while the server still waits for the other process's clients (not after its registration timeout)."""
    import threading

    from fedhop.common.config import parse_config
    from fedhop.server.child_reports import ChildReports
    from tests.cluster import Cluster
    from tests.helpers import quadratic_config

    centers = [[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [2.0, 1.0]]
    cfg = parse_config(quadratic_config(centers, [[1.0, 1.0]] * 4, [5, 7, 3, 4], rounds=3, name="lostsignal"))
    cluster = Cluster(cfg, tmp_path / "run")
    reports = ChildReports(cluster.coord)   # not installed: as if SIGUSR1's exception were lost
    try:
        cluster.add_client("client-proc0", [0, 1], heartbeats=False)
        if registered == "every client":
            cluster.add_client("client-proc1", [2, 3], heartbeats=False)
        reason = "client-proc0: PLUGIN_NOT_ALLOWED: the config names plug-in 'x:y'"
        replies: list = []
        refusal = threading.Thread(target=lambda: replies.append(reports.register(pb.RegisterRequest(
            node_id="client-proc0", role="client", refusal=reason))))
        refusal.start()
        refusal.join(30)
        assert replies and replies[0].accepted and "the run fails" in replies[0].message, replies
        started = time.monotonic()
        summary = cluster.run()
    finally:
        cluster.close()
    assert time.monotonic() - started < 25, "waited out the registration timeout (30 s)"
    assert (summary["status"], summary["rounds_completed"]) == ("failed", 0), summary
    assert summary["error"] == reason, summary


def npz_config(path: Path) -> str:
    """Two clients of the user's npz file, two rounds of FedAvg on a linear model."""
    return (f'[run]\nname = "setup-refusal"\nrounds = 2\n[algorithm]\nname = "fedavg"\nlr = 0.1\n'
            f'local_steps = 1\nbatch_size = 0\n[data]\ndataset = "npz"\npath = "{path}"\n[model]\n'
            f'kind = "logreg"\n[clients]\ncount = 2\nper_round = 2\n')


def test_a_client_whose_set_up_fails_on_the_configs_data_tells_the_server_and_exits_with_one_line(tmp_path):
    """The run's data file is where the server read it but gone when the client builds its share
    (another machine, another mount): the client says so in one line, tells the server, and the
    server fails the run at once with that reason (the client had printed a traceback and left the
    server to wait out its registration timeout)."""
    import numpy as np
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x_0=rng.normal(size=(6, 3)), y_0=np.array([0, 1] * 3), x_1=rng.normal(size=(6, 3)),
             y_1=np.array([1, 0] * 3))
    (tmp_path / "exp.toml").write_text(npz_config(data))
    run = Run.__new__(Run)
    run.tmp, run.run_dir, run.procs = tmp_path, tmp_path / "run", {}
    run.env = {k: v for k, v in os.environ.items() if k not in ("FEDHOP_TOKEN", plugins.ALLOW_ENV, "FEDHOP_NODE_CRED")}
    try:
        server = run.server()
        run.wait_for(lambda: Path(server).exists())   # the server has built its task from the file
        data.unlink()
        run.start("client-proc0", "client", "--parent-file", server, "--clients", "0-1", "--node-id", "client-proc0")
        assert run.procs["client-proc0"].wait(timeout=120) == 2, run.log("client-proc0")[-3000:]
        assert run.procs["server"].wait(timeout=120) == 1, run.log("server")[-3000:]
        client_log = run.log("client-proc0")
        assert "Traceback" not in client_log
        said = [line for line in client_log.splitlines() if "cannot set up from" in line]
        assert len(said) == 1 and "FileNotFoundError" in said[0] and "data.npz" in said[0], client_log[-2000:]
        (event,) = run.events("config_refused")
        assert event[0] == "client-proc0" and "cannot set up from" in event[1] and "data.npz" in event[1]
        summary = json.loads((run.run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and "client-proc0" in summary["error"]
        assert summary["rounds_completed"] == 0
    finally:
        run.close()
