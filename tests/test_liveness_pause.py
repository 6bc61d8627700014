"""Liveness that survives its own pauses (issue 17, item 4): a parent that did not run for a
while re-checks its children before declaring them dead; sampling never puts a dead node's
client in a live one's place; nothing lands in run.db after the run is final; an unreadable
newest checkpoint is skipped with an event."""
from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fedhop.common.records.runstore import RunStore
from fedhop.common.transport.liveness import LivenessMonitor, live_pool
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import LedgerRecord
from fedhop.server.resilience import ledger_consistency
from tests.faultkit import check_run_db, slow_quadratic, wait_dead, wait_for_round
from tests.test_faults import _start


class _Endpoint:
    node_id = "server"
    liveness = None


def _monitor(now: list[float]) -> tuple[LivenessMonitor, list]:
    events: list = []
    mon = LivenessMonitor(_Endpoint(), interval=1.0, timeout=5.0, on_event=lambda *e: events.append(e),
                          clock=lambda: now[0])
    mon.registered(pb.RegisterRequest(node_id="client-proc0", address="h:1", clients=[pb.LogicalClient(client_id=0)]))
    mon.beat(pb.HeartbeatRequest(node_id="client-proc0"))
    return mon, events


def test_a_paused_parent_gives_its_children_a_fresh_timeout():
    now = [0.0]
    mon, events = _monitor(now)
    mon.check()
    now[0] = 12.5                                   # the parent was stopped for 12 s
    assert mon.check() == []
    assert [e[0] for e in events] == ["monitor_paused"]
    for t in np.arange(12.75, 30.0, 0.25):         # checks resume at their period; the child stays silent:
        now[0] = float(t)                           # timeout 5 s + the 12.5 s gap of grace
        assert mon.check() == [], t
    now[0] = 30.25
    assert mon.check() == ["client-proc0"]


def test_a_silent_child_of_a_running_parent_is_still_declared_dead():
    now = [0.0]
    mon, events = _monitor(now)
    dead = []
    while now[0] < 6.0 and not dead:
        now[0] += 0.25
        dead = mon.check()
    assert dead == ["client-proc0"] and 5.0 < now[0] <= 5.25
    assert [e[0] for e in events] == ["node_dead"]


def test_a_child_that_registers_and_never_beats_is_declared_dead_after_its_set_up_grace():
    """A child killed during its set-up (after registering, before its first heartbeat) is
    declared dead SETUP_GRACE + the heartbeat timeout after it registered, not never; one that
    beats in time is not."""
    from fedhop.common.transport.liveness import SETUP_GRACE
    now = [100.0]
    events: list = []
    mon = LivenessMonitor(_Endpoint(), interval=1.0, timeout=5.0, on_event=lambda *e: events.append(e),
                          clock=lambda: now[0])
    for node in ("client-proc0", "client-proc1"):
        mon.registered(pb.RegisterRequest(node_id=node, address=f"h:{node[-1]}",
                                          clients=[pb.LogicalClient(client_id=int(node[-1]))]))
    dead = []
    while not dead:
        now[0] += 0.25
        if now[0] >= 110.0:   # proc1 is set up 10 s after registering and beats; proc0 never does
            mon.beat(pb.HeartbeatRequest(node_id="client-proc1"))
        dead = mon.check()
        assert now[0] < 100.0 + SETUP_GRACE + 10.0
    assert dead == ["client-proc0"]
    assert 100.0 + SETUP_GRACE + 5.0 < now[0] <= 100.0 + SETUP_GRACE + 5.25
    assert [e[0] for e in events] == ["node_dead"] and "since it registered" in events[0][2]


def test_sampling_pool_leaves_out_dead_nodes_only_when_a_subset_is_drawn():
    home = {c: SimpleNamespace(node_id=f"n{c % 2}") for c in range(6)}
    mon = SimpleNamespace(unavailable_nodes=lambda: {"n1"})
    assert live_pool(list(range(6)), 3, home, mon) == ([0, 2, 4], [1, 3, 5])
    assert live_pool(list(range(6)), 6, home, mon) == (list(range(6)), [])     # everyone drawn: as before
    assert live_pool(list(range(6)), 3, home, SimpleNamespace(unavailable_nodes=set)) == (list(range(6)), [])
    all_dead = SimpleNamespace(unavailable_nodes=lambda: {"n0", "n1"})
    assert live_pool(list(range(6)), 3, home, all_dead) == (list(range(6)), [])


def test_no_event_lands_after_the_run_is_final(tmp_path):
    store = RunStore(tmp_path / "run.db")
    store.start_run("r1")
    store.add_event("node_dead", node="edge-0", round=3)
    store.finish_run("completed")
    store.add_event("node_dead", node="edge-1", round=3)     # a monitor thread that had not stopped yet
    assert [e["node"] for e in store.events()] == ["edge-0"]
    store.start_run("r1")                                     # resumed: recording again
    store.add_event("resumed", node="server", round=3)
    assert len(store.events()) == 2


def test_server_stopped_for_seconds_does_not_declare_its_children_dead(tmp_path):
    """SIGSTOP the server process for 5 s (heartbeat timeout 1.5 s, children give up after 30 s);
    on SIGCONT the run goes on: no child marked dead, every round complete."""
    rounds = 5
    run, server = _start(tmp_path, slow_quadratic(rounds, processes=2), ["security.parent_timeout=30.0",
                                                                          "run.call_timeout=300.0",
                                                                          "run.round_timeout=300.0"])
    try:
        wait_for_round(run.run_dir, 2)
        os.kill(server.proc.pid, signal.SIGSTOP)
        time.sleep(5.0)                              # the fault itself: 5 s without the server
        os.kill(server.proc.pid, signal.SIGCONT)
        assert server.proc.wait(timeout=240) == 0
        wait_dead([c.proc.pid for c in run.children], timeout=30)
    finally:
        try:
            os.kill(server.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        run.stop_all()
    summary = check_run_db(run.run_dir, rounds)
    store = RunStore(run.run_dir / "run.db")
    assert store.events("node_dead") == [], store.events("node_dead")
    assert len(store.events("monitor_paused")) >= 1
    assert summary["liveness"]["marked_dead"] == 0
    assert not [e for e in store.events() if "NODE_DEAD" in (e["detail"] or "")]


def test_a_corrupt_newest_checkpoint_is_skipped_with_an_event(tmp_path):
    from fedhop.deploy.launch.launcher import resume_local
    rounds = 4
    run, server = _start(tmp_path, slow_quadratic(rounds, processes=2), ["run.checkpoint_every=1"])
    try:
        wait_for_round(run.run_dir, 3)
        server.proc.kill()
        server.proc.wait(timeout=30)
    finally:
        run.stop_all()
    ckpts = sorted((run.run_dir / "checkpoints").iterdir())
    assert len(ckpts) >= 2
    newest = ckpts[-1]
    files = sorted(p for p in newest.rglob("*") if p.is_file()) if newest.is_dir() else [newest]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])   # truncated
    assert resume_local(str(run.run_dir), quiet=True, show_table=False) == 0
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    skipped = RunStore(run.run_dir / "run.db").events("checkpoint_skipped")
    assert len(skipped) == 1 and newest.name in skipped[0]["detail"]


def test_a_child_registering_again_before_it_is_marked_dead_is_a_restart():
    """A process killed and restarted within the heartbeat timeout registers again while its node
    still counts as live: one `node_restarted` event (no `node_returned`: it was never dead)."""
    now = [0.0]
    mon, events = _monitor(now)
    now[0] = 1.0
    mon.registered(pb.RegisterRequest(node_id="client-proc0", address="h:1", clients=[pb.LogicalClient(client_id=0)]))
    assert [e[:2] for e in events] == [("node_restarted", "client-proc0")]
    assert mon.stats.reregistrations == 0


def _record(recorder: str, role: str, msg_id: str, src: str, dst: str, method: str, at: float) -> LedgerRecord:
    return LedgerRecord(run_id="r1", round=0, step=0, src=src, dst=dst, link="control", direction="control",
                        method=method, tensor_bytes=0, payload_bytes=12, framed_bytes=27, seconds=0.0,
                        recorder=recorder, role=role, msg_id=msg_id, status="ok", wall_time=at)


def test_a_heartbeat_of_a_process_killed_before_recording_it_is_explained_by_its_restart(tmp_path):
    """The soak's case: client-proc3 sends a heartbeat, is killed before writing its record, and its
    restarted process (same ledger file) records later messages.  The server's two records of that
    heartbeat are one-sided; `ledger_consistency` explains them by the node_restarted event and
    counts them unexplained without it."""
    store = RunStore(tmp_path / "run.db")
    store.start_run("r1")
    beat = "heartbeat-client-proc3-100.0-7"
    store.insert_records([
        _record("server", "receiver", beat, "client-proc3", "server", "heartbeat", 10.0),
        _record("server", "sender", beat + ".reply", "server", "client-proc3", "heartbeat.reply", 10.0),
        # the restarted process's own heartbeat, both ends recorded
        _record("client-proc3", "sender", "heartbeat-client-proc3-200.0-1", "client-proc3", "server", "heartbeat", 20.0),
        _record("server", "receiver", "heartbeat-client-proc3-200.0-1", "client-proc3", "server", "heartbeat", 20.0),
    ])
    before = ledger_consistency(store)
    assert not before["ok"] and before["unexplained"] == 2, before
    store.add_event("node_restarted", node="client-proc3", round=0, detail="registered again at h:3")
    after = ledger_consistency(store)
    assert after["ok"] and after["unexplained"] == 0 and after["lost_explained"] == 2, after


@pytest.mark.parametrize("later", [False, True])
def test_a_heartbeat_of_a_process_killed_for_good_before_recording_it_is_explained_by_its_ledgers_end(tmp_path, later):
    """The compose test's case: client-proc2 sends a heartbeat and is killed (not restarted,
    not yet marked dead) before it writes its record of the call or of the server's reply.  Its
    ledger ends before both of the server's records, so the heartbeat is explained by its
    sender's end and the reply by its receiver's; a process that records later was alive and
    missed them, and both stay unexplained."""
    store = RunStore(tmp_path / "run.db")
    store.start_run("r1")
    beat = "heartbeat-client-proc2-100.0-3"
    store.insert_records([
        _record("client-proc2", "sender", "heartbeat-client-proc2-90.0-2", "client-proc2", "server", "heartbeat", 9.0),
        _record("server", "receiver", "heartbeat-client-proc2-90.0-2", "client-proc2", "server", "heartbeat", 9.0),
        _record("server", "receiver", beat, "client-proc2", "server", "heartbeat", 10.0),
        _record("server", "sender", beat + ".reply", "server", "client-proc2", "heartbeat.reply", 10.0),
    ])
    if later:   # client-proc2 lives on: a later exchange recorded at both ends
        store.insert_records([
            _record("client-proc2", "sender", "heartbeat-client-proc2-110.0-4", "client-proc2", "server", "heartbeat", 11.0),
            _record("server", "receiver", "heartbeat-client-proc2-110.0-4", "client-proc2", "server", "heartbeat", 11.0)])
    report = ledger_consistency(store)
    if later:
        assert not report["ok"] and report["unexplained"] == 2, report
    else:
        assert report["ok"] and report["unexplained"] == 0 and report["lost_explained"] == 2, report
