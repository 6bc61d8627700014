"""Live accounting (issue 18, item 2): while a run is live every process's byte totals reach the
server with its heartbeats; when the run ends the live view equals the final table, link by link
and direction by direction, for star, hierarchical, sequential (Fed-CHS) and chain."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fedhop.common.records.runstore import RunStore
from fedhop.common.transport.livebytes import LinkCounter, Reported, counted_by
from fedhop.common.wire import fedhop_pb2 as pb
from fedhop.common.wire.ledger import LedgerRecord
from fedhop.deploy.launch.launcher import read_progress, run_local
from tests.helpers import quadratic_config

RNG = np.random.default_rng(5)
CENTERS = RNG.normal(0, 2, size=(8, 4))
CURV = RNG.uniform(0.5, 2.0, size=(8, 4))
SIZES = [5, 9, 13, 3, 7, 11, 2, 8]

TOPOLOGIES = {
    "star": 'kind = "star"',
    "hierarchical": 'kind = "hierarchical"\nedges = 2',
    "sequential": 'kind = "sequential"\nedges = 2\ngraph = "ring"\nsteps_per_round = 3\nstart = 0',
    "chain": 'kind = "chain"\nhops_per_round = 5',
}


def _record(src, dst, role, recorder, framed=100, link="client-server", direction="up"):
    return LedgerRecord(run_id="r", round=1, step=0, src=src, dst=dst, link=link, direction=direction,
                        method="train", tensor_bytes=framed - 40, payload_bytes=framed - 5, framed_bytes=framed,
                        seconds=0.0, recorder=recorder, role=role, msg_id="m", status="ok", wall_time=0.0)


@pytest.mark.parametrize("src,dst,role,tier,expected", [
    ("server", "client-3", "sender", 0, True),     # the server counts every message it takes part in
    ("client-3", "server", "receiver", 0, True),
    ("client-3", "server", "sender", 2, False),    # ... and its children do not count them again
    ("server", "client-3", "receiver", 2, False),
    ("edge-0", "client-3", "sender", 1, True),     # an edge counts its clients' messages, both ways
    ("client-3", "edge-0", "receiver", 1, True),
    ("client-3", "edge-0", "sender", 2, False),
    ("edge-0", "server", "sender", 1, False),      # the server counts the edge's
    ("edge-0", "edge-1", "sender", 1, True),       # peers: the sender counts
    ("edge-0", "edge-1", "receiver", 1, False),
    ("client-1", "client-4", "sender", 2, True),
    ("client-1", "client-4", "receiver", 2, False),
])
def test_each_message_is_counted_at_exactly_one_end(src, dst, role, tier, expected):
    assert counted_by(_record(src, dst, role, "x"), tier) is expected


def test_counter_sums_its_own_records_and_an_edge_relays_the_latest():
    counter = LinkCounter("edge-0")
    counter.observe(_record("edge-0", "client-1", "sender", "edge-0", 300, "client-edge", "down"))
    counter.observe(_record("client-1", "edge-0", "receiver", "edge-0", 200, "client-edge", "up"))
    counter.observe(_record("client-1", "edge-0", "receiver", "client-proc0", 999, "client-edge", "up"))  # not ours
    counter.observe(_record("edge-0", "server", "sender", "edge-0", 999, "edge-server", "up"))           # the server's
    got = {(e.link, e.direction): (e.messages, e.framed_bytes, e.tensor_bytes) for e in counter.entries()}
    assert got == {("client-edge", "down"): (1, 300, 260), ("client-edge", "up"): (1, 200, 160)}
    relay = Reported()
    relay.report([pb.LinkBytes(node_id="client-proc0", link="client-client", direction="peer", framed_bytes=5)])
    relay.report([pb.LinkBytes(node_id="client-proc0", link="client-client", direction="peer", framed_bytes=9)])
    assert [e.framed_bytes for e in relay.entries()] == [9]   # cumulative totals: the newer replaces


def test_a_counters_takes_add_up_in_another_counter_to_its_records_totals():
    """An in-process engine's worker counts its process's records and hands the counts over with
    each reply (deploy/launch/workers.py): what `take` gives, added in turn to the engine's
    counter, equals one counter that observed every record; each take starts from zero."""
    records = [_record("client-1", "client-4", "sender", "client-proc0", 100 + i, "client-client", "peer")
               for i in range(5)] + [_record("client-2", "client-5", "sender", "client-proc0", 50, "client-client", "peer"),
                                     _record("client-1", "client-4", "sender", "client-proc1", 999, "client-client", "peer"),
                                     _record("client-1", "server", "sender", "client-proc0", 999, "client-server", "up")]
    whole, worker, engine = (LinkCounter("client-proc0") for _ in range(3))
    for i, rec in enumerate(records):
        whole.observe(rec)
        worker.observe(rec)
        if i % 2:
            engine.add(worker.take())
    engine.add(worker.take())
    assert worker.take() == []
    assert [(e.link, e.direction, e.messages, e.framed_bytes, e.tensor_bytes) for e in engine.entries()] == \
        [(e.link, e.direction, e.messages, e.framed_bytes, e.tensor_bytes) for e in whole.entries()]
    assert sum(e.messages for e in engine.entries()) == 6   # another process's record and the server's are not counted here
    for bad in ([["client-server", "up", 1, 2, 3]], [["client-server", "up", 1, 2, 3, -4]],
                [["client-server", 7, 1, 2, 3, 4]], [["client-server", "up", 1, 2, 3, "4"]]):
        with pytest.raises(ValueError, match="byte count row"):
            engine.add(bad)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_live_view_ends_equal_to_the_final_table(tmp_path, topology):
    text = quadratic_config(CENTERS, CURV, SIZES, rounds=3, per_round=4, processes=2, local_steps=2,
                            topology=TOPOLOGIES[topology], algorithm="fedchs" if topology == "sequential" else "fedavg")
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    assert run_local(str(cfg), [], str(tmp_path / "run"), quiet=True) == 0
    store = RunStore(tmp_path / "run" / "run.db", create=False)
    final = store.bytes_by_link_direction()
    live = store.live_bytes_by_link_direction()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger_agreement"]["ok"]
    model_links = {"star": {"client-server"}, "hierarchical": {"client-edge", "edge-server"},
                   "sequential": {"client-edge", "edge-edge"}, "chain": set()}[topology]
    assert model_links <= set(live) and set(live) - {"control"}
    assert live == final
    # each round's row notes the live figure when it was recorded: the server's own counts are in it
    # (those of its links up to that round), and it only grows
    figures = [r["live_framed_bytes"] for r in store.rounds()]
    server_links = {"star": ["client-server"], "hierarchical": ["edge-server"], "sequential": ["edge-server"],
                    "chain": ["client-server"]}[topology]
    for r, figure in enumerate(figures, start=1):
        upto = store.bytes_by_link_upto(r)
        assert figure >= sum(upto[link]["framed_bytes"] for link in server_links) > 0
    assert figures == sorted(figures) and figures[-1] <= summary["bytes"]["total"]["framed_bytes"]
    last = read_progress(tmp_path / "run" / "run.db", 2, final=True)
    assert [r["round"] for r in last] == [3] and last[0]["bytes"] == summary["bytes"]["total"]["framed_bytes"]
    assert last[0]["failures"] == 0 and isinstance(last[0]["failures"], int)


def test_a_child_cannot_report_totals_for_its_parent_or_a_peer():
    from fedhop.common.transport.liveness import reports_for
    assert reports_for("client-proc0", "client-proc0", "server")
    assert reports_for("edge-1", "client-proc3", "server")        # an edge relays its clients'
    assert not reports_for("client-proc0", "server", "server")    # not the parent's own row
    assert not reports_for("client-proc0", "client-proc1", "server")
    assert not reports_for("edge-0", "edge-1", "server")
