"""A run outlives a dead client process (docs/faults.md, "When a process dies"): real OS processes
on loopback, one client process killed with SIGKILL mid-run, star and hierarchical.

With run.min_results = 3 of 3 sampled, every round that samples a client of the dead process is
short: run.on_short_round = "retry" samples it again among the live clients (a `round_retried`
event naming the dead process), and the failed call made the process suspect at once, so no
later round sends it anything."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fedhop.common.config import parse_config
from fedhop.common.records.runstore import RunStore
from fedhop.common.topologies.plan import plan_processes
from fedhop.common.transport.liveness import SETUP_GRACE, LivenessMonitor, live_pool, unreachable
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.deploy.launch.launcher import LocalRun, read_progress
from tests.helpers import quadratic_config

COUNT, PER_ROUND, ROUNDS, KILL_AFTER = 20, 3, 40, 2
RNG = np.random.default_rng(26)
CENTERS = RNG.normal(0, 2, size=(COUNT, 4))
CURV = RNG.uniform(0.5, 2.0, size=(COUNT, 4))
SIZES = [int(s) for s in RNG.integers(2, 9, size=COUNT)]


def config_text(topology: str, processes: int) -> str:
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=ROUNDS, per_round=PER_ROUND, processes=processes,
                            local_steps=1, topology=topology)
    return text.replace("round_timeout = 60.0", "round_timeout = 60.0\nmin_results = 3\non_short_round = \"retry\"")


def run_killing_one(tmp_path, topology: str, processes: int, victim_index: int):
    """Start the run, SIGKILL client process `victim_index` once round KILL_AFTER is in run.db, wait
    for the end; returns (summary, store, the victim's node id, its clients, the round reached at the kill)."""
    cfg = parse_config(config_text(topology, processes))
    victim = plan_processes(cfg).clients[victim_index]
    run = LocalRun(cfg, tmp_path / "run", workdir=tmp_path)
    server = run.start([])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not read_progress(run.run_dir / "run.db", KILL_AFTER - 1):
            if server.proc.poll() is not None:
                break
            time.sleep(0.02)
        progress = read_progress(run.run_dir / "run.db", 0)
        assert progress, "no round recorded before the kill"
        killed_at = max(row["round"] for row in progress)
        assert killed_at < ROUNDS - 10, f"the run was at round {killed_at} of {ROUNDS} before the kill"
        child = next(c for c in run.children if c.name == victim.node_id)
        os.kill(child.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=240)
    finally:
        run.stop_all()
    assert server.proc.returncode == 0, (run.run_dir / "logs" / "server.log").read_text()[-3000:]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    return summary, RunStore(run.run_dir / "run.db"), victim.node_id, set(victim.clients), killed_at


def train_ids(store: RunStore, method: str, column: str, after: int) -> set[int]:
    """The client ids in `column` (src or dst) of the `method` messages (train, train.reply)
    after round `after`, as recorded by either side."""
    con = sqlite3.connect(store.path)
    try:
        rows = con.execute(f"SELECT DISTINCT {column} FROM messages WHERE method = ? AND round > ?",
                           (method, after)).fetchall()
    finally:
        con.close()
    return {int(node.split("-")[1]) for (node,) in rows if node.startswith("client-")}


@pytest.mark.parametrize("topology,processes,victim_index", [
    ('kind = "star"', 2, 1),
    ('kind = "hierarchical"\nedges = 2', 4, 3),   # edge-1 keeps one live process of two
])
def test_killed_client_process_run_retries_and_completes(tmp_path, topology, processes, victim_index):
    summary, store, victim, victim_clients, killed_at = run_killing_one(tmp_path, topology, processes, victim_index)
    assert summary["status"] == "completed", summary["error"]
    assert summary["rounds_completed"] == ROUNDS
    rounds = store.rounds()
    assert [r["round"] for r in rounds] == sorted({r["round"] for r in rounds})
    assert len(rounds) + summary["rounds_skipped"] == ROUNDS
    assert all(r["participants"] == PER_ROUND for r in rounds)   # min_results = 3: only full rounds count

    failed = {int(e["node"].split("-")[1]) for e in store.events("client_failed")}
    assert failed and failed <= victim_clients, (failed, victim_clients)
    retried = store.events("round_retried")
    assert retried and all(victim in e["detail"] or "edge-1" in e["detail"] for e in retried)
    assert summary["round_retries"] == len(retried) and summary["failures"] >= len(failed)

    live = set(range(COUNT)) - victim_clients
    # no reply from the dead process's clients after the round in flight at the kill
    replies = train_ids(store, "train.reply", "src", killed_at + 1)
    assert replies and replies <= live
    # once its failure is known (the last retry or skip), no train call goes to its clients any more
    known = max(e["round"] for e in retried + store.events("round_skipped"))
    calls = train_ids(store, "train", "dst", known)
    assert calls and calls <= live, sorted(calls & victim_clients)
    if topology.endswith("2"):
        reported = [e for e in store.events("clients_unavailable") if e["node"] == "edge-1"]
        assert reported, "edge-1 never reported its dead client process"
    else:
        assert [e["node"] for e in store.events("node_suspect")] == [victim]
        # the victim is suspect from its first failed call on: the live clients are the others
        # (Coordinator.live_count, counted by node)
        assert all(f"among {COUNT - len(victim_clients)} live clients" in e["detail"] for e in retried), retried


class _Endpoint:
    node_id = "server"
    liveness = None


def test_a_failed_call_makes_a_process_suspect_at_once_and_dead_a_timeout_later():
    """A process that never beat but whose call failed is dead the heartbeat timeout after the
    failure, not SETUP_GRACE later; one that beats after a failed call is cleared."""
    now = [100.0]
    events: list = []
    mon = LivenessMonitor(_Endpoint(), interval=1.0, timeout=5.0, on_event=lambda *e: events.append(e),
                          clock=lambda: now[0])
    for k in range(2):
        mon.registered(pb.RegisterRequest(node_id=f"client-proc{k}", address=f"h:{k}",
                                          clients=[pb.LogicalClient(client_id=k)]))
    now[0] = 103.0
    why = "call to client-0 failed (UNAVAILABLE): Connection refused"
    assert mon.suspect("client-proc0", why) and not mon.suspect("client-proc0", why)   # once
    assert mon.suspect("client-proc1", "timeout: no result within run.round_timeout=60.0s")
    assert mon.unavailable_nodes() == {"client-proc0", "client-proc1"} and mon.dead_nodes() == set()
    now[0] = 104.0
    mon.beat(pb.HeartbeatRequest(node_id="client-proc1"))        # proc1 lives: no longer suspect
    assert mon.unavailable_nodes() == {"client-proc0"}
    dead = []
    while not dead:
        now[0] += 0.25
        dead = mon.check()
        assert now[0] < 103.0 + SETUP_GRACE
    assert dead == ["client-proc0"] and 108.0 < now[0] <= 108.25
    assert [e[0] for e in events] == ["node_dead"] and "since a call to it failed" in events[0][2]
    home = {c: SimpleNamespace(node_id=f"client-proc{c % 2}") for c in range(6)}
    assert live_pool(list(range(6)), 2, home, mon) == ([1, 3, 5], [0, 2, 4])
    assert live_pool(list(range(6)), 2, home, mon, {3}) == ([1, 5], [0, 2, 3, 4])   # an edge's report too


@pytest.mark.parametrize("why,dead", [
    ("call to client-3 failed (UNAVAILABLE): failed to connect to all addresses", True),
    ("call to client-3 failed (NODE_DEAD): node client-proc1 marked dead", True),
    ("call to client-3 failed (DEADLINE_EXCEEDED): Deadline Exceeded", True),
    ("timeout: no result within run.round_timeout=60.0s", True),
    ("call to client-3 failed (UNAUTHENTICATED): bad token", False),
    ("client-3 replied BAD_SHAPE: w has shape [3]", False),
    ("NON_FINITE: tensor w holds NaN", False),
])
def test_unreachable_tells_a_dead_process_from_a_live_one(why, dead):
    assert unreachable(why) is dead


def test_a_retry_draws_from_its_own_stream_reproducibly():
    """Attempt k of round r is a function of (seed, r, k) and the live pool: another engine (a
    resumed server) draws the same clients; attempt 0 is the round's usual draw."""
    from fedhop.common.engine.rounds import RoundEngine
    from fedhop.common.util.rng import numpy_stream
    cfg = parse_config(config_text('kind = "star"', 2))
    a, b = RoundEngine(cfg), RoundEngine(cfg)
    live = lambda pool, size: [c for c in pool if c < 10]   # client-proc1 (10..19) dead
    differs = 0
    for r in range(1, 21):
        first = a.sample(r, restrict=live, attempt=1)
        assert first == b.sample(r, restrict=live, attempt=1) and set(first) < set(range(10))
        rng = numpy_stream(cfg.run.seed, "sampling", r, "attempt", 1)
        assert first == sorted(int(i) for i in rng.choice(10, size=PER_ROUND, replace=False))
        assert a.sample(r) == b.sample(r)
        differs += first != a.sample(r, restrict=live)
    assert differs >= 15   # its own stream, not the round's first draw again
